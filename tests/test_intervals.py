"""Bootstrap intervals over questions: point values, coverage of the obvious, pairing; and the exchange
test against its exact enumeration."""

from __future__ import annotations

import itertools

import pytest

from marspec.eval.intervals import difference_interval, exchange_p_value, mean_interval, ratio_interval


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


def exact_exchange_p(samples: list[list[float]], reference: list[list[float]]) -> float:
    """The exchange test's p-value by enumerating every reassignment of every question's pooled samples."""
    per_question = []
    observed = 0.0
    for mine, theirs in zip(samples, reference, strict=True):
        pool, n = [*mine, *theirs], len(mine)
        observed += sum(mine) / n - sum(theirs) / len(theirs)
        splits = []
        for chosen in itertools.combinations(range(len(pool)), n):
            rest = [pool[i] for i in range(len(pool)) if i not in chosen]
            splits.append(sum(pool[i] for i in chosen) / n - sum(rest) / len(rest))
        per_question.append(splits)
    totals = [sum(parts) for parts in itertools.product(*per_question)]
    return sum(abs(t) >= abs(observed) - 1e-9 for t in totals) / len(totals)


@pytest.mark.parametrize(
    ("samples", "reference"),
    [
        ([[1.0], [0.0], [1.0], [1.0]], [[0.0], [0.0], [1.0], [0.0]]),  # greedy: a sign flip, exactly 0.5
        ([[1, 1, 0], [0, 1, 1], [1, 1, 1]], [[0, 0, 0], [0, 1, 0], [1, 0, 1]]),  # 3 samples each
        ([[1, 0], [1, 1], [0, 0], [1, 1]], [[0, 1], [0, 0], [0, 1], [1, 0]]),
    ],
)
def test_the_exchange_test_matches_its_exact_enumeration(samples, reference):
    exact = exact_exchange_p(samples, reference)
    assert exchange_p_value(samples, reference) == pytest.approx(exact, abs=0.01)


def test_the_exchange_test_tells_one_distribution_from_two():
    same = [[1, 0, 1]] * 10
    assert exchange_p_value(same, same) == 1.0
    assert exchange_p_value([[1, 1, 1]] * 10, [[0, 0, 0]] * 10) < 0.001
    with pytest.raises(ValueError, match="same questions"):
        exchange_p_value([[1]], [])
    with pytest.raises(ValueError, match="at least one sample"):
        exchange_p_value([[1], []], [[0], [1]])
