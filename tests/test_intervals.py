"""Bootstrap intervals over questions: point values, coverage of the obvious, pairing."""

from __future__ import annotations

import pytest

from marspec.eval.intervals import difference_interval, mean_interval, ratio_interval


def test_mean_interval_brackets_the_mean_and_shrinks_with_more_questions():
    few = mean_interval([1, 0, 1, 1, 0, 1, 0, 1, 1, 1])
    many = mean_interval([1, 0, 1, 1, 0, 1, 0, 1, 1, 1] * 10)
    assert few.value == many.value == pytest.approx(0.7)
    assert few.lo < 0.7 < few.hi and many.lo < 0.7 < many.hi
    assert many.hi - many.lo < few.hi - few.lo
    assert mean_interval([]).value is None


def test_identical_methods_recover_exactly_100_percent():
    scores = [1, 0, 1, 1, 0, 0.5]
    est = ratio_interval(scores, scores)
    assert est.value == 1.0 and (est.lo, est.hi) == (1.0, 1.0)
    assert difference_interval(scores, scores).to_dict() == {"value": 0.0, "lo": 0.0, "hi": 0.0}


def test_one_lost_answer_in_thirty_gives_an_interval_that_includes_100_percent():
    reference = [1.0] * 20 + [0.0] * 10
    method = [1.0] * 19 + [0.0] * 11
    est = ratio_interval(method, reference)
    assert est.value == pytest.approx(19 / 20)
    assert est.lo < est.value <= est.hi <= 1.0 and est.contains(1.0)


def test_many_lost_answers_exclude_100_percent_and_are_paired():
    reference = [1.0] * 30
    method = [1.0] * 20 + [0.0] * 10
    assert not ratio_interval(method, reference).contains(1.0)
    diff = difference_interval(method, reference)
    assert diff.value == pytest.approx(-1 / 3) and diff.hi < 0


def test_zero_reference_and_mismatched_lengths():
    assert ratio_interval([1, 0], [0, 0]).value is None
    with pytest.raises(ValueError, match="same questions"):
        ratio_interval([1], [1, 0])
