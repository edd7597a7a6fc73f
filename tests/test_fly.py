"""FLy (marspec.verify.fly_defers and the rule "fly"): every branch on hand-made logits, a reference
check on random ones, validation, and where it is refused."""

from __future__ import annotations

import math

import pytest
import torch

from marspec.defaults import DEFAULT_MARGIN, FLY_THETA, FLY_WINDOW
from marspec.errors import MarspecError
from marspec.rules import FLY_MAX_ENTROPY, RULES, Rule
from marspec.settings import settle_rule
from marspec.verify import (
    fly_defers,
    relaxed_accepts,
    top2,
    verify_greedy,
    verify_sampling,
    verify_tree_greedy,
)

STRICT = Rule("strict")
FLY = Rule("fly", 0.3, window=2)
NEG = float("-inf")


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rows(*r: list[float]) -> torch.Tensor:
    return torch.tensor(r, dtype=torch.float32)


def tok(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def logs(*p: float) -> list[float]:
    return [math.log(x) if x > 0 else NEG for x in p]


def top3_entropy(p: list[float]) -> float:
    return -sum(x * math.log(x) for x in sorted(p, reverse=True)[:3] if x > 0)


# An uncertain row (top-3 entropy 1.056 nats >= 0.3); its top-1 is token 0.
UNSURE_P = [0.4, 0.35, 0.2, 0.05]
UNSURE = logs(*UNSURE_P)
# A confident row (top-3 entropy 0.122 < 0.3), top-1 token 0.
SURE_P = [0.97, 0.01, 0.01, 0.01]
SURE = logs(*SURE_P)


def picks(token: int) -> list[float]:
    """A row whose top-1 is ``token`` with probability ~1."""
    row = [0.0, 0.0, 0.0, 0.0]
    row[token] = 30.0
    return row


def test_the_hand_made_rows_sit_on_both_sides_of_the_threshold() -> None:
    assert top3_entropy(UNSURE_P) > 0.3 > top3_entropy(SURE_P)


def test_a_mismatch_followed_by_a_window_of_matches_is_deferred() -> None:
    # Draft 1 where the target prefers 0 (uncertain), then 2 and 3, which the target picks after it.
    out = verify_greedy(rows(UNSURE, picks(2), picks(3), picks(1)), tok(1, 2, 3), FLY)
    assert (out.n_accepted, out.next_token, out.relaxed.tolist()) == (3, 1, [True, False, False])
    assert out.top1 is not None and out.top1[0] == 0  # the token strict would have taken


def test_a_window_with_a_mismatch_is_not_deferred() -> None:
    out = verify_greedy(rows(UNSURE, picks(2), picks(0), picks(1)), tok(1, 2, 3), FLY)
    assert (out.n_accepted, out.next_token, out.n_relaxed) == (0, 0, 0)  # strict's correction


def test_a_window_that_does_not_fit_in_the_draft_is_not_deferred() -> None:
    # Window 2, but only one draft token follows the mismatch (the bonus row is not a draft token).
    out = verify_greedy(rows(UNSURE, picks(2), picks(3)), tok(1, 2), FLY)
    assert (out.n_accepted, out.next_token) == (0, 0)


def test_a_confident_target_is_not_deferred() -> None:
    out = verify_greedy(rows(SURE, picks(2), picks(3), picks(1)), tok(1, 2, 3), FLY)
    assert (out.n_accepted, out.next_token) == (0, 0)


def test_a_draft_token_the_target_rules_out_is_never_deferred() -> None:
    # Three equal tokens (entropy ln 3, the most there is) but the draft's token has probability 0.
    flat = [0.0, 0.0, 0.0, NEG]
    assert verify_greedy(rows(flat, picks(2), picks(3), picks(1)), tok(3, 2, 3), FLY).n_accepted == 0
    assert verify_greedy(rows(flat, picks(2), picks(3), picks(1)), tok(1, 2, 3), FLY).n_relaxed == 1


def test_the_entropy_gate_is_at_least_theta() -> None:
    h = top3_entropy(UNSURE_P)
    block = rows(UNSURE, picks(2), picks(3), picks(1)), tok(1, 2, 3)
    assert verify_greedy(*block, Rule("fly", h - 1e-4, window=2)).n_relaxed == 1
    assert verify_greedy(*block, Rule("fly", h + 1e-4, window=2)).n_relaxed == 0


def test_two_mismatches_a_window_apart_are_both_deferred_and_closer_ones_are_not() -> None:
    # Mismatches at 0 and 3, each followed by two matches: both deferred.
    apart = rows(UNSURE, picks(1), picks(2), UNSURE, picks(1), picks(2), picks(3))
    out = verify_greedy(apart, tok(3, 1, 2, 3, 1, 2), FLY)
    assert (out.n_accepted, out.relaxed.tolist(), out.next_token) == (
        6,
        [True, False, False, True, False, False],
        3,
    )
    # Mismatches at 0 and 2: the first one's window holds the second, so neither is deferred at 0.
    close = rows(UNSURE, picks(1), UNSURE, picks(1), picks(2), picks(3))
    out = verify_greedy(close, tok(3, 1, 3, 1, 2), FLY)
    assert (out.n_accepted, out.next_token) == (0, 0)


def test_blocks_of_a_flattened_batch_do_not_lend_each_other_windows() -> None:
    logits = rows(UNSURE, picks(1), picks(2), picks(3), picks(0))  # five draft positions
    draft = tok(3, 1, 2, 3, 0)
    native = draft == logits.argmax(-1)
    assert native.tolist() == [False, True, True, True, True]
    one_block = fly_defers(logits, draft, native, FLY)
    assert one_block.tolist() == [True, False, False, False, False]
    # The first block is [3, 1]: only one token follows its mismatch, the next block's do not count.
    two_blocks = fly_defers(logits, draft, native, FLY, lengths=tok(2, 3))
    assert not two_blocks.any()
    assert fly_defers(logits, draft, native, FLY, lengths=tok(3, 2)).tolist() == one_block.tolist()


def test_the_entropy_is_measured_at_the_temperature() -> None:
    # p = [0.9, 0.05, 0.05, 0]: top-3 entropy 0.394 at T = 1, lower once sharpened at T = 0.5.
    row = logs(0.9, 0.05, 0.05, 0.0)
    logits = rows(row, picks(2), picks(3))
    draft, native = tok(1, 2, 3), torch.tensor([False, True, True])
    assert fly_defers(logits, draft, native, FLY, temperature=1.0).tolist() == [True, False, False]
    assert not fly_defers(logits, draft, native, FLY, temperature=0.5).any()


def reference_fly(logits: torch.Tensor, draft: torch.Tensor, rule: Rule) -> tuple[int, int, list[bool]]:
    """FLy greedy written position by position: (accepted, next token, relaxed flags)."""
    k = draft.shape[0]
    top1 = logits.argmax(-1).tolist()
    native = [int(draft[i]) == top1[i] for i in range(k)]
    accepted, relaxed = 0, []
    for i in range(k):
        p = torch.softmax(logits[i].double(), -1)
        entropy = -sum(float(x) * math.log(float(x)) for x in p.topk(3).values if x > 0)
        window = rule.window or 0
        deferred = (
            not native[i]
            and p[int(draft[i])] > 0
            and entropy >= rule.theta
            and i + window < k
            and all(native[i + 1 : i + 1 + window])
        )
        if not (native[i] or deferred):
            break
        accepted += 1
        relaxed.append(deferred)
    return accepted, top1[accepted], relaxed


@pytest.mark.parametrize("rule", [FLY, Rule("fly", 0.0, window=1), Rule("fly", 0.8, window=3)])
def test_greedy_fly_matches_a_position_by_position_reference(rule: Rule) -> None:
    gen = torch.Generator().manual_seed(0)
    deferred = 0
    for _ in range(400):
        logits = torch.randn(7, 5, generator=gen) * 1.5
        # Drafts mostly the target's choice, sometimes not, so windows of matches occur.
        draft = logits[:6].argmax(-1)
        swap = torch.rand(6, generator=gen) < 0.25
        draft = torch.where(swap, torch.randint(0, 5, (6,), generator=gen), draft)
        out = verify_greedy(logits, draft, rule)
        n, nxt, relaxed = reference_fly(logits, draft, rule)
        assert (out.n_accepted, out.next_token, out.relaxed.tolist()) == (n, nxt, relaxed)
        deferred += sum(relaxed)
    assert deferred > 20  # the random cases exercised the deferral, not only exact matches


@pytest.mark.parametrize(
    "never", [Rule("fly", 2.0, window=6), Rule("fly", 1.1, window=1), Rule("fly", 0.3, window=9)]
)
def test_fly_that_cannot_defer_equals_strict(never: Rule) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        logits = torch.randn(9, 4, generator=gen) * 0.5  # flat rows: high entropy everywhere
        draft = torch.where(torch.rand(8, generator=gen) < 0.8, logits[:8].argmax(-1), torch.tensor(0))
        ours, strict = verify_greedy(logits, draft, never), verify_greedy(logits, draft, STRICT)
        assert (ours.n_accepted, ours.next_token, ours.n_relaxed) == (strict.n_accepted, strict.next_token, 0)


def test_sampling_defers_a_failed_draw_when_the_window_passes() -> None:
    # Row 0 gives the draft token 3 probability 0.05 (q = 1: a lossless draw accepts 5% of the time);
    # rows 1 and 2 give their draft tokens probability 1, so their draws always pass.
    logits = rows(UNSURE, picks(2), picks(3), picks(1))
    strict_rejections = 0
    for seed in range(60):
        out = verify_sampling(logits, tok(3, 2, 3), None, FLY, 1.0, torch.Generator().manual_seed(seed))
        assert out.n_accepted == 3  # passed its draw, or deferred
        strict = verify_sampling(logits, tok(3, 2, 3), None, STRICT, 1.0, torch.Generator().manual_seed(seed))
        assert out.n_relaxed == (strict.n_accepted == 0)  # relaxed exactly where the draw failed
        strict_rejections += strict.n_accepted == 0
    assert strict_rejections > 40
    # A window whose draft token the target rules out (p = 0) never passes: no deferral.
    blocked = rows(UNSURE, logs(0.5, 0.5, 0.0, 0.0), picks(3), picks(1))
    for seed in range(30):
        out = verify_sampling(blocked, tok(3, 2, 3), None, FLY, 1.0, torch.Generator().manual_seed(seed))
        assert out.n_relaxed == 0 and out.n_accepted <= 1


def test_fly_rule_defaults_names_and_relaxes() -> None:
    assert "fly" in RULES
    assert settle_rule("fly") == Rule("fly", FLY_THETA, DEFAULT_MARGIN, window=FLY_WINDOW)
    assert settle_rule("fly") == Rule("fly", 0.3, DEFAULT_MARGIN, window=6)
    never = Rule("fly", FLY_MAX_ENTROPY + 1e-9, window=6)
    assert Rule("fly", FLY_MAX_ENTROPY, window=6).relaxes and not never.relaxes
    assert Rule("fly", 0, window=6).relaxes and isinstance(Rule("fly", 1, window=6).theta, float)


@pytest.mark.parametrize("theta", [-0.1, float("nan"), float("inf"), True, "0.3"])
def test_fly_theta_is_validated(theta: object) -> None:
    with pytest.raises(MarspecError, match=r"invalid for rule 'fly'.*entropy threshold"):
        Rule("fly", theta)  # type: ignore[arg-type]


@pytest.mark.parametrize("window", [0, -2, 1.5, True, "6"])
def test_fly_window_is_validated(window: object) -> None:
    with pytest.raises(MarspecError, match=r"window=.* is invalid for rule 'fly'"):
        Rule("fly", 0.3, window=window)  # type: ignore[arg-type]


def test_only_fly_takes_a_window_and_fly_takes_no_next_guard() -> None:
    with pytest.raises(MarspecError, match="window is FLy's"):
        Rule("mars", 0.5, "prob_ratio", window=3)
    with pytest.raises(MarspecError, match="'next' guard is MARS's"):
        Rule("fly", 0.3, guard="next", window=6)


def test_fly_is_refused_where_it_cannot_apply() -> None:
    from marspec.decode import DecodeConfig
    from marspec.drafters import Draft
    from marspec.drafters.tree import build_tree

    logits = rows(UNSURE, picks(2))
    values, tokens = top2(logits)
    with pytest.raises(MarspecError, match="fly_defers"):
        relaxed_accepts(logits, values, tokens, tok(1, 2), FLY)  # a row-wise caller (the vLLM plugin)
    with pytest.raises(MarspecError, match="not a token tree"):
        DecodeConfig(rule=FLY, k=4, max_new_tokens=8, tree=(2,))
    tree = build_tree(Draft(tokens=tok(1), alternatives=tok(2)[None]), (2,))
    with pytest.raises(MarspecError, match="not a token tree"):
        verify_tree_greedy(torch.zeros(len(tree) + 1, 4), tree, FLY)
