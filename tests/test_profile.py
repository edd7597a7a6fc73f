"""Forward-cost profiles and the ideal time they imply."""

from __future__ import annotations

import pytest
from conftest import tiny_lm

from marspec.profile import ForwardCosts, ideal_seconds, measure, profile_pair


def test_costs_interpolate_between_and_extrapolate_beyond_measured_sizes():
    costs = ForwardCosts(context=256, target={1: 0.3, 3: 0.5, 5: 0.9}, draft={1: 0.05})
    assert costs.target_s(3) == 0.5
    assert costs.target_s(2) == pytest.approx(0.4)
    assert costs.target_s(4) == pytest.approx(0.7)
    assert costs.target_s(7) == pytest.approx(1.3)  # the last segment's slope continues
    assert costs.draft_s(1) == 0.05
    assert ForwardCosts(256, {1: 0.3}).draft_s(1) == 0.0  # no draft model, no draft cost


def test_ideal_time_adds_every_verification_and_draft_forward():
    costs = ForwardCosts(context=256, target={1: 0.3, 6: 0.8}, draft={1: 0.05})
    # JSON keys arrive as strings: both spellings count.
    assert ideal_seconds({"6": 10, 1: 2}, draft_forwards=50, costs=costs) == pytest.approx(
        10 * 0.8 + 2 * 0.3 + 50 * 0.05
    )


def test_round_trip_through_json_keys():
    costs = ForwardCosts(context=64, target={1: 0.1, 2: 0.15}, draft={1: 0.01})
    data = {"context": 64, "target": {"1": 0.1, "2": 0.15}, "draft": {"1": 0.01}}
    assert ForwardCosts.from_dict(data) == costs
    assert ForwardCosts.from_dict(costs.to_dict()) == costs


def test_measure_on_a_tiny_model_leaves_its_cache_empty():
    lm = tiny_lm(0)
    costs = measure(lm, [1, 4], context=16, repeats=2)
    assert set(costs) == {1, 4} and all(s > 0 for s in costs.values())
    assert lm.cached_len == 0
    pair = profile_pair(lm, tiny_lm(1), max_tokens=3, context=16, repeats=1)
    assert sorted(pair.target) == [1, 2, 3] and sorted(pair.draft) == [1, 2]
