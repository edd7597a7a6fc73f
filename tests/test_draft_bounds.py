"""benchmarks/draft_bounds.py: the cost model's speed under a pair's measured costs and with one cost made
ideal at a time, on stubbed measurements (no model, nothing timed)."""

from __future__ import annotations

from types import ModuleType

import pytest
from conftest import benchmark_module

from marspec.draft_length import decide
from marspec.draft_length.measure import Measured


@pytest.fixture(scope="module")
def draft_bounds() -> ModuleType:
    return benchmark_module("draft_bounds")


def measured(step_ms: float, per_row_ms: float, draft_ms: float, informative: bool = True) -> Measured:
    """A target whose forward costs one step plus ``per_row_ms`` a further row, and a draft whose tokens
    are accepted 90% of the time (or, ``informative``, 2 in 3, the confident ones more often)."""
    target = {rows: (step_ms + per_row_ms * (rows - 1)) / 1000 for rows in range(1, 17)}
    if informative:
        confidences, accepted = [0.95, 0.9, 0.8, 0.6, 0.4, 0.2] * 20, ([True] * 4 + [False] * 2) * 20
        return Measured(target, draft_ms / 1000, confidences, accepted)
    return Measured(target, draft_ms / 1000, [0.5] * 100, [True] * 90 + [False] * 10)


def test_the_measured_bound_is_the_pairs_own_choice(draft_bounds: ModuleType) -> None:
    m = measured(35.0, 4.0, 13.0)
    best, choice = draft_bounds.bounds(m)["measured"], decide(m)
    assert (best.k, best.stop, best.tokens_per_s) == (choice.k, choice.stop, choice.prediction.tokens_per_s)


def test_each_ideal_cost_is_at_least_as_fast_and_frees_what_it_names(draft_bounds: ModuleType) -> None:
    dear = draft_bounds.bounds(measured(35.0, 6.0, 13.0, informative=False))
    speeds = {name: p.tokens_per_s for name, p in dear.items()}
    assert speeds["free verification"] > speeds["measured"]
    assert speeds["free draft"] > speeds["draft at half cost"] > speeds["measured"]
    # With verification dear and no stop to end a draft early, freeing it lets the draft run longer.
    assert dear["free verification"].k > dear["measured"].k


def test_a_verification_already_as_cheap_as_a_step_has_nothing_to_win(draft_bounds: ModuleType) -> None:
    flat = draft_bounds.bounds(measured(35.0, 0.0, 13.0))
    assert flat["free verification"].tokens_per_s == pytest.approx(flat["measured"].tokens_per_s)
