"""The draft length and confidence stop chosen from stubbed costs: the cost model alone, no models."""

from __future__ import annotations

import pytest

from marspec.draft_length.cost_model import Acceptance, Costs, batched, choose, drafting_pays, predict, rising
from marspec.errors import MarspecError


def costs(step: float, per_row: float, draft: float = 0.2, rows: int = 16) -> Costs:
    """A target whose forward over n rows costs ``step + per_row * (n - 1)``; a draft step of ``draft``."""
    return Costs({n: step + per_row * (n - 1) for n in range(1, rows + 1)}, draft)


def always(alpha: float) -> Acceptance:
    """No confidence stop: every token is drafted, each accepted at ``alpha``."""
    return Acceptance(0.0, 1.0, alpha, 0.0)


def test_without_a_stop_it_is_the_standard_model() -> None:
    alpha, k, c = 0.7, 5, costs(1.0, 0.1)
    p = predict(k, always(alpha), c)
    assert p.tokens_per_step == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))
    assert p.drafted_per_step == k
    assert p.seconds_per_step == pytest.approx(k * 0.2 + 1.0 + 0.1 * k)


def test_dear_verification_picks_a_short_draft_and_cheap_a_long_one() -> None:
    acceptance = [always(0.9)]
    dear = choose(costs(1.0, 0.3, draft=0.1), acceptance)  # 13 rows cost 4.6 steps, as on Zen 4 (issue 79)
    cheap = choose(costs(1.0, 0.01, draft=0.1), acceptance)  # 13 rows cost about one step (AMX, int8 rows)
    assert dear.k <= 4 and cheap.k >= 8


def test_the_choice_shortens_as_verification_or_the_draft_grows_dearer() -> None:
    acceptance = [always(0.75)]
    by_row_cost = [choose(costs(1.0, slope), acceptance).k for slope in (0.0, 0.02, 0.05, 0.1, 0.2, 0.4)]
    assert by_row_cost == sorted(by_row_cost, reverse=True) and by_row_cost[0] > by_row_cost[-1]
    by_draft_cost = [choose(costs(1.0, 0.02, d), acceptance).k for d in (0.02, 0.1, 0.3, 0.6)]
    assert by_draft_cost == sorted(by_draft_cost, reverse=True) and by_draft_cost[0] > by_draft_cost[-1]


def test_the_choice_lengthens_as_acceptance_grows() -> None:
    by_alpha = [choose(costs(1.0, 0.05), [always(a)]).k for a in (0.3, 0.5, 0.7, 0.85, 0.95)]
    assert by_alpha == sorted(by_alpha) and by_alpha[0] < by_alpha[-1]


def test_speed_falls_as_any_cost_rises() -> None:
    cheap, dear_draft, dear_rows = costs(1.0, 0.05, 0.1), costs(1.0, 0.05, 0.3), costs(1.0, 0.2, 0.1)
    for k in (1, 4, 12):
        base = modelled(k, always(0.7), cheap)
        assert base > modelled(k, always(0.7), dear_draft)
        assert base > modelled(k, always(0.7), dear_rows)
        assert base < modelled(k, always(0.8), cheap)


def modelled(k, acceptance, machine) -> float:
    """The cost model's tokens a second for stubbed costs: arithmetic, no clock (the timing guard's
    concern is measured rates)."""
    return predict(k, acceptance, machine).tokens_per_s


def test_a_stop_that_separates_good_tokens_from_bad_is_taken_where_tokens_are_dear() -> None:
    # Sure tokens (70%) are accepted 95% of the time, unsure ones 20%: stopping at an unsure one saves
    # the forwards that would be spent past it, most of them wasted.
    confidences = [0.9] * 70 + [0.3] * 30
    accepted = [True] * 66 + [False] * 4 + [True] * 6 + [False] * 24
    table = [Acceptance.measured(stop, confidences, accepted) for stop in (0.0, 0.5)]
    assert table[1].sure == pytest.approx(0.7) and table[1].accept_unsure == pytest.approx(0.2)
    assert table[0].alpha == pytest.approx(table[1].alpha)  # the stop changes who drafts, not the tokens
    dear = choose(costs(1.0, 0.2, 0.4), table)
    assert dear.stop == 0.5
    stopped, unstopped = (
        predict(dear.k, table[1], costs(1.0, 0.2, 0.4)),
        predict(dear.k, table[0], costs(1.0, 0.2, 0.4)),
    )
    assert stopped.drafted_per_step < unstopped.drafted_per_step


def test_costs_between_measured_rows_are_interpolated_and_beyond_them_refused() -> None:
    c = Costs({1: 1.0, 4: 1.6, 8: 2.4}, 0.1)
    assert c.verify(2) == pytest.approx(1.2) and c.max_k == 7
    with pytest.raises(MarspecError, match="k must be in"):
        predict(8, always(0.5), c)
    with pytest.raises(MarspecError, match="one-row"):
        Costs({2: 1.0}, 0.1)


def test_a_cost_above_a_larger_forwards_is_taken_as_noise() -> None:
    # Measured on a shared machine: 5 rows caught a slow stretch and cost more than 6 and 7.
    measured = {1: 1.0, 2: 1.2, 3: 1.5, 4: 1.4, 5: 2.4, 6: 2.1, 7: 2.0, 8: 2.6}
    assert rising(measured) == {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.4, 5: 2.0, 6: 2.0, 7: 2.0, 8: 2.6}


def test_a_batch_counts_each_sequences_rows_in_one_forward_and_grows_the_draft_alike() -> None:
    c = costs(1.0, 0.1, draft=0.2)
    step = batched(4, c)
    # n rows of each of 4 sequences: 4n rows
    assert step.target == {n: pytest.approx(1.0 + 0.1 * (4 * n - 1)) for n in range(1, 5)}
    assert step.draft == pytest.approx(0.2 * 1.3)  # the target's forward grows 1.3x from one row to four
    with pytest.raises(MarspecError, match="no target cost measured at 32 rows"):
        batched(32, c)


def test_drafting_pays_in_a_batch_where_rows_are_cheap_and_not_where_they_are_dear() -> None:
    acceptance = Acceptance(0.55, 0.76, 0.94, 0.35)  # a draft that stops after its unsure tokens
    # Rows nearly free (AMX, int8 rows): four sequences drafting two tokens each beat one row each.
    assert drafting_pays(4, 2, acceptance, costs(1.0, 0.01, draft=0.2))
    # Rows past four as dear as on a 2-core Zen 4: one row each is faster; two sequences still draft.
    zen4 = Costs({1: 1.0, 2: 1.0, 3: 1.02, 4: 1.04, **{n: 1.04 + 0.16 * (n - 4) for n in range(5, 17)}}, 0.36)
    assert not drafting_pays(4, 2, acceptance, zen4)
    assert drafting_pays(2, 5, acceptance, zen4)
    # Past the rows measured there is nothing to weigh: drafting is kept.
    assert drafting_pays(4, 4, acceptance, zen4)
