"""Tests for marspec.verify: every branch of the greedy and sampling accept rules, plus statistical checks."""

from __future__ import annotations

import math

import pytest
import torch

from marspec.errors import MarspecError
from marspec.rules import MARGINS, RULES, Rule
from marspec.verify import (
    Verification,
    _sample,
    is_close_call,
    margin_measure,
    top2,
    verify_greedy,
    verify_sampling,
)

MARS = Rule("mars", 0.9, "logit_ratio")
STRICT = Rule("strict")

# Upper 0.999 quantiles of the chi-square distribution by degrees of freedom (checked against the
# regularised incomplete gamma function: torch.special.gammainc(df / 2, x / 2) == 0.999).
CHI2_999 = {3: 16.266, 63: 103.442}
# Statistical tests: vocabulary size and speculative steps per test.
VOCAB = 4
N_TRIALS = 12_000
TEMPERATURE = 0.7


@pytest.fixture(autouse=True)
def _one_thread():
    """Run on one intra-op thread: these tensors are tiny, and on a busy machine waking a thread pool for
    every op (softmax parallelises over rows) makes each call ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tok(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def rows(*r: list[float]) -> torch.Tensor:
    return torch.tensor(r, dtype=torch.float32)


# Row 0: a close call between tokens 0 and 1 (4.75 / 5 = 0.95 > 0.9); token 2 is third.
CLOSE = [5.0, 4.75, 1.0, 0.0]
# Row with a clear winner: 3.0 / 5.0 = 0.6 <= 0.9.
CLEAR = [5.0, 3.0, 1.0, 0.0]
# Top logit far ahead at token 3, used as the bonus row.
BONUS = [0.0, 1.0, 2.0, 9.0]


# --------------------------------------------------------------------------------------------- Rule


def test_rule_defaults_and_names() -> None:
    assert Rule() == Rule("strict")  # unnamed is strict, as everywhere; a Rule fills nothing else in
    assert RULES == ("strict", "mars", "typical", "pthresh", "topk", "fly", "block", "ensemble")
    assert MARGINS == ("logit_ratio", "prob_ratio", "logit_gap")


@pytest.mark.parametrize(
    ("rule", "relaxes"),
    [
        (Rule("strict"), False),
        (Rule("mars", 0.9, "logit_ratio"), True),
        (Rule("mars", 0.0, "logit_ratio"), True),
        (Rule("mars", 1.0, "logit_ratio"), False),
        (Rule("mars", 1.0, "prob_ratio"), False),
        (Rule("mars", 0.5, "prob_ratio"), True),
        (Rule("mars", 0.0, "logit_gap"), False),
        (Rule("mars", 3.0, "logit_gap"), True),
        (Rule("strict", 3.0, "logit_gap"), False),
        (Rule("typical", 0.0), False),
        (Rule("typical", 0.09), True),
        (Rule("pthresh", 1.0), False),
        (Rule("pthresh", 0.3), True),
        (Rule("topk", 1), False),
        (Rule("topk", 3), True),
    ],
)
def test_rule_relaxes(rule: Rule, relaxes: bool) -> None:
    assert rule.relaxes is relaxes


def test_rule_theta_is_stored_as_float() -> None:
    rule = Rule("mars", 1, "logit_ratio")
    assert isinstance(rule.theta, float)
    assert rule.theta == 1.0


@pytest.mark.parametrize("theta", [-0.1, 1.5, math.nan, math.inf, "0.9", True])
@pytest.mark.parametrize("margin", ["logit_ratio", "prob_ratio"])
def test_rule_rejects_bad_ratio_theta(theta: object, margin: str) -> None:
    with pytest.raises(MarspecError, match=r"in \[0, 1\]") as info:
        Rule("mars", theta, margin)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    assert "lower relaxes more" in message
    assert "theta = 1 can never relax" in message


@pytest.mark.parametrize("theta", [-0.1, -1.0, math.nan, math.inf])
def test_rule_rejects_bad_gap_theta(theta: float) -> None:
    with pytest.raises(MarspecError, match=r">= 0") as info:
        Rule("mars", theta, "logit_gap")
    assert "0 never relaxes" in str(info.value)


def test_rule_gap_theta_may_exceed_one() -> None:
    assert Rule("mars", 2.5, "logit_gap").theta == 2.5


def test_rule_rejects_unknown_rule_and_margin() -> None:
    with pytest.raises(MarspecError, match=r"unknown rule 'eagle'.*strict, mars"):
        Rule("eagle")  # type: ignore[arg-type]
    with pytest.raises(MarspecError, match=r"unknown margin 'entropy'.*logit_ratio, prob_ratio, logit_gap"):
        Rule("mars", 0.9, "entropy")  # type: ignore[arg-type]


def test_rule_validates_theta_for_strict_too() -> None:
    with pytest.raises(MarspecError):
        Rule("strict", 1.5)


# ---------------------------------------------------------------------------------- top2 and margins


def test_top2_values_tokens_and_batch_shape() -> None:
    logits = torch.tensor([[[1.0, 7.0, 3.0, 5.0]], [[2.0, -1.0, 0.0, -3.0]]])  # [2, 1, 4]
    values, tokens = top2(logits)
    assert values.shape == tokens.shape == (2, 1, 2)
    assert tokens.tolist() == [[[1, 3]], [[0, 2]]]
    assert values.tolist() == [[[7.0, 5.0]], [[2.0, 0.0]]]


def test_top2_first_token_is_argmax_under_ties() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 3, (500, 5), generator=gen).float()  # integer logits: many ties
    values, tokens = top2(logits)
    assert torch.equal(tokens[:, 0], logits.argmax(-1))
    assert torch.all(tokens[:, 0] != tokens[:, 1])
    expected = logits.topk(2, dim=-1).values
    assert torch.equal(values, expected)


def test_top2_exact_tie_gives_both_tied_tokens() -> None:
    values, tokens = top2(torch.tensor([1.0, 3.0, 3.0, 0.0]))
    assert tokens.tolist() == [1, 2]
    assert values.tolist() == [3.0, 3.0]


def test_margin_measures() -> None:
    z1, z2 = torch.tensor([4.0, 2.0]), torch.tensor([3.0, 1.0])
    assert torch.allclose(margin_measure(z1, z2, "logit_ratio"), torch.tensor([0.75, 0.5]))
    assert torch.allclose(margin_measure(z1, z2, "prob_ratio"), torch.exp(torch.tensor([-1.0, -1.0])))
    assert torch.allclose(margin_measure(z1, z2, "prob_ratio", 2.0), torch.exp(torch.tensor([-0.5, -0.5])))
    assert torch.allclose(margin_measure(z1, z2, "logit_gap"), torch.tensor([1.0, 1.0]))
    # The ratio is scale-free: temperature does not change it.
    assert torch.allclose(margin_measure(z1, z2, "logit_ratio", 0.3), torch.tensor([0.75, 0.5]))
    with pytest.raises(MarspecError, match="unknown margin"):
        margin_measure(z1, z2, "entropy")  # type: ignore[arg-type]


def test_prob_ratio_equals_softmax_ratio() -> None:
    logits = torch.tensor([2.0, 1.3, -0.5])
    p = torch.softmax(logits / 0.7, -1)
    measure = margin_measure(logits[0], logits[1], "prob_ratio", 0.7)
    assert torch.allclose(measure, p[1] / p[0])


def test_is_close_call_each_margin() -> None:
    z1 = torch.tensor([5.0, 5.0, -1.0, 0.0, 2.0])
    z2 = torch.tensor([4.75, 3.0, -1.05, -0.01, 2.0])
    assert is_close_call(z1, z2, MARS).tolist() == [True, False, False, False, True]
    prob = Rule("mars", 0.7, "prob_ratio")  # exp(-0.25)=0.78, exp(-2)=0.14, exp(-0.05)=0.95, ~0.99, 1
    assert is_close_call(z1, z2, prob).tolist() == [True, False, True, True, True]
    gap = Rule("mars", 0.5, "logit_gap")
    assert is_close_call(z1, z2, gap).tolist() == [True, False, True, True, True]
    assert is_close_call(z1, z2, Rule("mars", 0.0, "logit_gap")).tolist() == [False] * 5


def test_is_close_call_strict_is_always_false() -> None:
    z = torch.tensor([3.0, 3.0])
    assert not is_close_call(z, z, STRICT).any()
    assert is_close_call(z, z, MARS).all()


def test_is_close_call_prob_ratio_uses_temperature() -> None:
    z1, z2 = torch.tensor([3.0]), torch.tensor([2.0])  # exp(-1) = 0.37; exp(-1/4) = 0.78
    rule = Rule("mars", 0.5, "prob_ratio")
    assert not is_close_call(z1, z2, rule).item()
    assert is_close_call(z1, z2, rule, temperature=4.0).item()


# ----------------------------------------------------------------------------------- verify_greedy


def test_greedy_exact_accept() -> None:
    out = verify_greedy(rows(CLEAR, BONUS), tok(0), MARS)
    assert (out.n_accepted, out.next_token, out.n_relaxed) == (1, 3, 0)
    assert out.relaxed.tolist() == [False]


def test_greedy_relaxed_accept_of_second_choice() -> None:
    out = verify_greedy(rows(CLOSE, BONUS), tok(1), MARS)
    assert (out.n_accepted, out.next_token, out.n_relaxed) == (1, 3, 1)
    assert out.relaxed.tolist() == [True]
    assert out.margins.tolist() == pytest.approx([0.95])


def test_greedy_strict_rejects_second_choice_with_argmax_correction() -> None:
    out = verify_greedy(rows(CLOSE, BONUS), tok(1), STRICT)
    assert (out.n_accepted, out.next_token, out.n_relaxed) == (0, 0, 0)
    assert out.relaxed.shape == (0,)


def test_greedy_rejects_second_choice_when_ratio_not_above_theta() -> None:
    out = verify_greedy(rows(CLEAR, BONUS), tok(1), MARS)
    assert (out.n_accepted, out.next_token) == (0, 0)
    # Exactly at theta is not a close call: the test is strict ">".
    at_theta = verify_greedy(rows([5.0, 4.5, 0.0], [0.0, 0.0, 1.0]), tok(1), MARS)
    assert at_theta.margins.tolist() == pytest.approx([0.9])
    assert at_theta.n_accepted == 0


def test_greedy_rejects_third_choice_even_on_close_call() -> None:
    out = verify_greedy(rows(CLOSE, BONUS), tok(2), Rule("mars", 0.0, "logit_ratio"))
    assert (out.n_accepted, out.next_token) == (0, 0)


@pytest.mark.parametrize("top", [[-1.0, -1.05, -5.0, -6.0], [0.0, -0.01, -5.0, -6.0], [0.0, 0.0, -1.0, -2.0]])
def test_greedy_guard_non_positive_top_logit_never_relaxes(top: list[float]) -> None:
    out = verify_greedy(rows(top, BONUS), tok(1), Rule("mars", 0.0, "logit_ratio"))
    assert (out.n_accepted, out.next_token) == (0, 0)
    # The other margins are meaningful for negative logits and do relax here.
    for rule in (Rule("mars", 0.9, "prob_ratio"), Rule("mars", 0.1, "logit_gap")):
        assert verify_greedy(rows(top, BONUS), tok(1), rule).n_relaxed == 1


def test_greedy_exact_tie() -> None:
    tie = rows([2.0, 3.0, 3.0, 0.0], BONUS)  # argmax is token 1; token 2 ties with it
    relaxed = verify_greedy(tie, tok(2), Rule("mars", 0.99, "logit_ratio"))
    assert (relaxed.n_accepted, relaxed.n_relaxed) == (1, 1)
    strict = verify_greedy(tie, tok(2), Rule("mars", 1.0, "logit_ratio"))
    assert (strict.n_accepted, strict.next_token) == (0, 1)
    assert strict.next_token == int(tie[0].argmax())
    exact = verify_greedy(tie, tok(1), Rule("mars", 1.0, "logit_ratio"))
    assert (exact.n_accepted, exact.n_relaxed) == (1, 0)


def test_greedy_k0_is_plain_greedy() -> None:
    """An empty draft (a plain step, a batch's sequence drafting nothing) takes the short way: the
    target's top token, ties and NaN as top-2's first, and empty flags, margins and top-1 of the
    general path's types, whatever the rule."""
    gen = torch.Generator().manual_seed(0)
    tied, nan = rows([1.0, 3.0, 3.0, 0.0]), rows([1.0, math.nan, 3.0, 0.0])
    cases = [torch.randn(1, 11, generator=gen) for _ in range(20)] + [tied, nan]
    for logits in cases:
        for rule in (MARS, STRICT, Rule("pthresh", 0.3), Rule("typical", 0.2)):
            out = verify_greedy(logits, tok(), rule)
            assert (out.n_accepted, out.next_token, out.tokens) == (0, int(top2(logits)[1][0, 0]), ())
            assert out.next_token == int(logits[0].argmax())
            assert out.relaxed.shape == out.margins.shape == out.top1.shape == (0,)
            assert (out.relaxed.dtype, out.margins.dtype, out.top1.dtype) == (
                torch.bool,
                torch.float32,
                torch.long,
            )


def test_greedy_all_accepted_gives_bonus_from_last_row() -> None:
    out = verify_greedy(rows(CLEAR, CLOSE, CLEAR, BONUS), tok(0, 1, 0), MARS)
    assert (out.n_accepted, out.next_token, out.n_relaxed) == (3, 3, 1)
    assert out.relaxed.tolist() == [False, True, False]
    assert out.emitted() == [0, 1, 0, 3]


def test_greedy_first_rejection_stops_acceptance() -> None:
    # Position 1 rejects (token 2 is third); positions 2 and 3 would match exactly but must not count.
    draft = tok(0, 2, 0, 3)
    out = verify_greedy(rows(CLEAR, CLOSE, CLEAR, BONUS, CLEAR), draft, MARS)
    assert (out.n_accepted, out.next_token) == (1, 0)
    assert out.emitted() == [0, 0]
    assert out.margins.shape == (4,)


def test_greedy_margins_follow_rule_margin() -> None:
    logits = rows(CLOSE, CLEAR, BONUS)
    assert verify_greedy(logits, tok(0, 0), MARS).margins.tolist() == pytest.approx([0.95, 0.6])
    gap = verify_greedy(logits, tok(0, 0), Rule("mars", 1.0, "logit_gap"))
    assert gap.margins.tolist() == pytest.approx([0.25, 2.0])
    assert gap.margins.dtype == torch.float32


def test_greedy_accepts_low_precision_logits() -> None:
    logits = rows(CLOSE, BONUS).to(torch.bfloat16)
    out = verify_greedy(logits, tok(1), MARS)
    assert (out.n_accepted, out.next_token, out.n_relaxed) == (1, 3, 1)
    assert out.margins.dtype == torch.float32


def test_greedy_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"\[K\+1, V\]"):
        verify_greedy(rows(CLOSE), tok(0), MARS)
    with pytest.raises(ValueError, match="integer tensor"):
        verify_greedy(rows(CLOSE, BONUS), torch.tensor([0.0]), MARS)


def _reference_greedy(logits: torch.Tensor, draft: list[int], rule: Rule) -> tuple[int, int, list[bool]]:
    """The SPEC's rule position by position, written as plainly as possible."""
    relaxed: list[bool] = []
    for i, d in enumerate(draft):
        row = logits[i].tolist()
        v1 = max(range(len(row)), key=lambda j: (row[j], -j))  # first maximum, like argmax
        v2 = max((j for j in range(len(row)) if j != v1), key=lambda j: (row[j], -j))
        z1, z2 = row[v1], row[v2]
        if d == v1:
            relaxed.append(False)
            continue
        close = False
        if rule.name == "mars" and d == v2:
            if rule.margin == "logit_ratio":
                close = z1 > 0 and z2 / z1 > rule.theta
            elif rule.margin == "prob_ratio":
                close = math.exp(z2 - z1) > rule.theta
            else:
                close = z1 - z2 < rule.theta
        if not close:
            return i, v1, relaxed
        relaxed.append(True)
    return len(draft), int(logits[len(draft)].argmax()), relaxed


def _random_block(gen: torch.Generator, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of either sign with frequent close calls, and drafts that are mostly top-1 or top-2."""
    logits = torch.randn(k + 1, vocab, generator=gen) * 2 + torch.randn(1, generator=gen) * 3
    _, tokens = top2(logits[:k])
    pick = torch.randint(0, 3, (k,), generator=gen)
    other = torch.randint(0, vocab, (k,), generator=gen)
    draft = torch.where(pick < 2, tokens.gather(1, pick.clamp(max=1)[:, None])[:, 0], other)
    return logits, draft


@pytest.mark.parametrize(
    "rule",
    [
        STRICT,
        MARS,
        Rule("mars", 0.5, "logit_ratio"),
        Rule("mars", 0.6, "prob_ratio"),
        Rule("mars", 1.0, "logit_gap"),
    ],
)
def test_greedy_matches_position_by_position_reference(rule: Rule) -> None:
    gen = torch.Generator().manual_seed(7)
    n_relaxed = 0
    for trial in range(300):
        k = trial % 6
        logits, draft = _random_block(gen, k, vocab=4)
        out = verify_greedy(logits, draft, rule)
        n, nxt, relaxed = _reference_greedy(logits, draft.tolist(), rule)
        assert (out.n_accepted, out.next_token, out.relaxed.tolist()) == (n, nxt, relaxed)
        n_relaxed += out.n_relaxed
    assert (n_relaxed > 0) == rule.relaxes  # the random blocks do exercise the relaxed branch


@pytest.mark.parametrize(
    "never",
    [Rule("mars", 1.0, "logit_ratio"), Rule("mars", 1.0, "prob_ratio"), Rule("mars", 0.0, "logit_gap")],
)
def test_greedy_rule_that_cannot_relax_equals_strict(never: Rule) -> None:
    gen = torch.Generator().manual_seed(3)
    for trial in range(500):
        logits, draft = _random_block(gen, trial % 5, vocab=3)
        a, b = verify_greedy(logits, draft, never), verify_greedy(logits, draft, STRICT)
        assert (a.n_accepted, a.next_token) == (b.n_accepted, b.next_token)
        assert not a.relaxed.any()


def test_verification_emitted_and_n_relaxed() -> None:
    out = Verification(2, 9, torch.tensor([True, False]), torch.zeros(3), tokens=(4, 5))
    assert out.emitted() == [4, 5, 9]
    assert out.n_relaxed == 1


class OnDevice(torch.Tensor):
    """A CPU tensor standing for one on an accelerator: every read of its values by the host (a
    synchronisation there) is logged; the copy ``.cpu()`` makes is a plain tensor, free to read."""

    reads: list[str] = []  # noqa: RUF012 (shared log, cleared by each test)
    HOST_READS = ("cpu", "tolist", "item", "numpy", "__int__", "__float__", "__bool__", "__index__")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in cls.HOST_READS:
            cls.reads.append(name)
            if name == "cpu":
                return args[0].as_subclass(torch.Tensor).clone()
        return super().__torch_function__(func, types, args, kwargs or {})


def test_verification_reads_the_device_once() -> None:
    """A decode step waits on the device once: everything the loop reads of a verification (accepted
    count, next token, accepted tokens, relaxed flags, margins, top-1) arrives in one copy."""
    logits = rows(CLOSE, [0.0, 1.0, 0.5, 3.0], CLOSE, BONUS).as_subclass(OnDevice)
    draft = tok(1, 2, 0).as_subclass(OnDevice)
    for rule in (MARS, STRICT, Rule("typical", 0.2)):
        for sampling in (False, True):
            OnDevice.reads.clear()
            if sampling:
                out = verify_sampling(logits, draft, None, rule, 1.0, torch.Generator().manual_seed(0))
            else:
                out = verify_greedy(logits, draft, rule)
            assert OnDevice.reads == ["cpu"], rule
            assert isinstance(out.n_accepted, int) and isinstance(out.next_token, int)
            assert type(out.relaxed) is type(out.margins) is type(out.top1) is torch.Tensor
            out.relaxed.tolist(), out.margins.tolist(), out.top1.tolist()
            assert OnDevice.reads == ["cpu"]


# --------------------------------------------------------------------------------- verify_sampling


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.nan, math.inf])
def test_sampling_refuses_bad_temperature(temperature: float) -> None:
    with pytest.raises(MarspecError, match=r"temperature.*> 0"):
        verify_sampling(rows(CLOSE, BONUS), tok(1), None, MARS, temperature)


def test_sampling_rejects_bad_draft_probs_shape() -> None:
    with pytest.raises(ValueError, match="draft_probs"):
        verify_sampling(rows(CLOSE, BONUS), tok(1), torch.ones(2, 4) / 4, STRICT, 1.0)


def test_sampling_sure_accepts_then_bonus_from_last_row() -> None:
    sure = [30.0, -30.0, -30.0, -30.0]  # p(0) == 1.0 in float32, so u < p(0) always
    bonus = [-30.0, -30.0, -30.0, 30.0]
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        out = verify_sampling(rows(sure, sure, bonus), tok(0, 0), None, STRICT, 1.0, gen)
        assert (out.n_accepted, out.next_token) == (2, 3)


def test_sampling_sure_rejection_samples_from_residual() -> None:
    # Draft token 2 has p = 0: always rejected; the residual p - q puts all its mass on token 1.
    row = [-30.0, 30.0, -math.inf, -30.0]
    q = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        out = verify_sampling(rows(row, CLEAR, BONUS), tok(2, 0), q, STRICT, 1.0, gen)
        assert (out.n_accepted, out.next_token) == (0, 1)
        none = verify_sampling(rows(row, CLEAR, BONUS), tok(2, 0), None, STRICT, 1.0, gen)
        assert (none.n_accepted, none.next_token) == (0, 1)


def test_sampling_k0_samples_target() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = rows([0.0, 1.0, 2.0])
    counts = torch.zeros(3)
    for _ in range(3000):
        out = verify_sampling(logits, tok(), None, MARS, 1.0, gen)
        assert out.n_accepted == 0
        counts[out.next_token] += 1
    assert torch.allclose(counts / counts.sum(), torch.softmax(logits[0], -1), atol=0.03)


def test_sampling_residual_fallback_when_residual_is_all_zero() -> None:
    # q = 2p is not a distribution, but it makes max(0, p - q) all zero after a rejection.
    logits = rows([0.0, 0.0], [0.0, 0.0])
    q = torch.tensor([[1.0, 1.0]])
    seen = set()
    for seed in range(200):
        out = verify_sampling(logits, tok(0), q, STRICT, 1.0, torch.Generator().manual_seed(seed))
        seen.add((out.n_accepted, out.next_token))
    assert seen == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_sample_never_draws_zero_weight_tokens() -> None:
    weights = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0])
    assert _sample(weights, torch.tensor(0.0)).item() == 1
    assert _sample(weights, torch.tensor(1.0 - 2.0**-24)).item() == 3
    assert _sample(weights, torch.tensor(1.0)).item() == 3
    assert _sample(weights, torch.tensor(0.29)).item() == 1
    assert _sample(weights, torch.tensor(0.31)).item() == 3


def test_sampling_mars_close_call_accepts_second_choice_without_a_draw() -> None:
    for seed in range(50):
        gen = torch.Generator().manual_seed(seed)
        out = verify_sampling(rows(CLOSE, BONUS), tok(1), None, MARS, 1.0, gen)
        assert (out.n_accepted, out.n_relaxed) == (1, 1)
        # At a close call the top-1 token is taken deterministically too, and counts as relaxed.
        q = torch.tensor([[1.0, 0.0, 0.0, 0.0]])  # q(0) = 1 > p(0), so a lossless test would sometimes reject
        top = verify_sampling(rows(CLOSE, BONUS), tok(0), q, MARS, 1.0, gen)
        assert (top.n_accepted, top.n_relaxed) == (1, 1)


def test_sampling_mars_close_call_is_measured_at_temperature() -> None:
    # z2/z1 = 0.95 at every temperature; prob_ratio p2/p1 = exp(-0.25 / T) passes 0.9 only for T > 2.37.
    prob = Rule("mars", 0.9, "prob_ratio")
    hot = verify_sampling(rows(CLOSE, BONUS), tok(1), None, prob, 3.0, torch.Generator().manual_seed(0))
    assert hot.n_relaxed == 1
    assert hot.margins.tolist() == pytest.approx([math.exp(-0.25 / 3.0)])
    logit = verify_sampling(rows(CLOSE, BONUS), tok(1), None, MARS, 0.2, torch.Generator().manual_seed(0))
    assert logit.margins.tolist() == pytest.approx([0.95])
    assert logit.n_relaxed == 1
    counts = 0
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        cold = verify_sampling(rows(CLOSE, BONUS), tok(1), None, prob, 1.0, gen)
        assert cold.n_relaxed == 0
        counts += cold.n_accepted
    assert 40 < counts < 120  # accepted with probability p(1) = 0.43, not always


def _key(out: Verification) -> tuple[int, int, list[bool]]:
    return out.n_accepted, out.next_token, out.relaxed.tolist()


@pytest.mark.parametrize(
    "rule",
    [Rule("mars", 1.0, "logit_ratio"), Rule("mars", 1.0, "prob_ratio"), Rule("mars", 0.0, "logit_gap")],
)
def test_sampling_rule_that_cannot_relax_equals_strict(rule: Rule) -> None:
    gen = torch.Generator().manual_seed(11)
    for trial in range(300):
        k = trial % 4
        logits, draft = _random_block(gen, k, vocab=3)
        q = torch.softmax(torch.randn(k, 3, generator=gen), -1) if trial % 2 else None
        seed = int(torch.randint(0, 2**31, (1,), generator=gen))
        a = verify_sampling(logits, draft, q, rule, 0.8, torch.Generator().manual_seed(seed))
        b = verify_sampling(logits, draft, q, STRICT, 0.8, torch.Generator().manual_seed(seed))
        assert _key(a) == _key(b)


def test_sampling_guard_and_clear_rows_behave_like_strict() -> None:
    # Negative top logits (the z1 <= 0 guard) and a clear winner: MARS must make the same random choices.
    for row in ([-1.0, -1.05, -5.0, -6.0], CLEAR):
        logits = rows(row, BONUS)
        for seed in range(100):
            a = verify_sampling(logits, tok(1), None, MARS, 1.0, torch.Generator().manual_seed(seed))
            b = verify_sampling(logits, tok(1), None, STRICT, 1.0, torch.Generator().manual_seed(seed))
            assert _key(a) == _key(b)
            assert a.n_relaxed == 0


# ------------------------------------------------------------------------------- statistical tests


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _random_dist(gen: torch.Generator, spread: float, *shape: int) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, generator=gen) * spread, dim=-1)


def _three_token_run(draft_probs_known: bool, n_trials: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run K=2 speculative steps against a target whose next-token distribution depends on the prefix.

    Returns the target's joint distribution of the first three tokens ``[V**3]`` and the counts of the
    first three tokens produced (the rest of a sequence after a short step is sampled from the target, as
    the next plain step would). Three tokens cover every branch: a correction at position 1 or 2 and the
    bonus token.
    """
    vocab = VOCAB
    gen = torch.Generator().manual_seed(1234)
    # A flat target keeps every one of the V**3 chi-square cells well populated; a sharper drafter
    # disagrees with it often, so rejections and residual samples are common.
    p1, p2, p3 = (_random_dist(gen, 0.5, *(vocab,) * i) for i in (1, 2, 3))
    q1, q2 = (_random_dist(gen, 1.5, *(vocab,) * i) for i in (1, 2))
    d1 = torch.multinomial(q1, n_trials, replacement=True, generator=gen)  # [N]
    d2 = torch.multinomial(q2[d1], 1, generator=gen)[:, 0]  # [N]
    # Target logits for prefix + (x, y): rows score position 1, position 2 (after x), the bonus (after x, y).
    # Scaled by the temperature so that softmax(logits / T) is exactly the target p.
    logits = {
        (x, y): torch.stack([p1, p2[x], p3[x, y]]).log() * TEMPERATURE
        for x in range(vocab)
        for y in range(vocab)
    }
    # Without draft_probs the verifier treats each draft as certain, like an n-gram drafter's guess; its
    # guesses still vary from step to step (drawn from the skewed q here), which the verifier never sees.
    draft_probs = [torch.stack([q1, q2[x]]) if draft_probs_known else None for x in range(vocab)]

    verify_gen = torch.Generator().manual_seed(99)
    emitted = []
    for x, y, draft in zip(d1.tolist(), d2.tolist(), torch.stack([d1, d2], 1).unbind(0), strict=True):
        out = verify_sampling(logits[x, y], draft, draft_probs[x], STRICT, TEMPERATURE, verify_gen)
        emitted.append([*out.emitted(), -1, -1][:3])
    tokens = torch.tensor(emitted).T  # [3, N], -1 where the step ended early
    assert 0.1 < (tokens[1] < 0).float().mean() < 0.9  # corrections at position 1 are common but not all
    assert 0.04 < (tokens[2] >= 0).float().mean() < 0.9  # and so are bonus tokens
    # Complete short steps with plain target samples, as the next decoding step would.
    short = tokens[1] < 0
    tokens[1, short] = torch.multinomial(p2[tokens[0, short]], 1, generator=gen)[:, 0]
    short = tokens[2] < 0
    tokens[2, short] = torch.multinomial(p3[tokens[0, short], tokens[1, short]], 1, generator=gen)[:, 0]
    joint = (p1[:, None, None] * p2[:, :, None] * p3).flatten()  # [V**3]
    cells = (tokens[0] * vocab + tokens[1]) * vocab + tokens[2]
    return joint, torch.bincount(cells, minlength=vocab**3).float()


@pytest.mark.parametrize("draft_probs_known", [True, False], ids=["draft_probs", "deterministic_drafter"])
def test_lossless_sampling_reproduces_target_distribution(draft_probs_known: bool) -> None:
    joint, counts = _three_token_run(draft_probs_known, n_trials=N_TRIALS)
    first_p = joint.view(VOCAB, -1).sum(1)
    first_counts = counts.view(VOCAB, -1).sum(1)
    tv = 0.5 * float((first_counts / N_TRIALS - first_p).abs().sum())
    assert tv < 0.015
    assert _chi2(first_counts, first_p) < CHI2_999[VOCAB - 1]
    assert _chi2(counts, joint) < CHI2_999[VOCAB**3 - 1]


def test_mars_sampling_is_lossy_on_a_close_call() -> None:
    # Drafts always propose the target's second choice at a close call (ratio 0.95, p(1) = 0.43).
    logits = rows(CLOSE, BONUS)
    p = torch.softmax(logits[0], -1)
    n_trials = 1000
    results = {}
    for rule in (STRICT, MARS):
        gen = torch.Generator().manual_seed(5)
        counts = torch.zeros(4)
        for _ in range(n_trials):
            counts[verify_sampling(logits, tok(1), None, rule, 1.0, gen).emitted()[0]] += 1
        results[rule.name] = 0.5 * float((counts / n_trials - p).abs().sum())
        if rule is MARS:
            assert counts[1] == n_trials  # every step took the second choice
    assert results["strict"] < 0.05
    assert results["mars"] > 0.5


# ------------------------------------------------------------------------------- the "next" guard

NEXT = Rule("mars", 0.9, "logit_ratio", guard="next")


def test_next_guard_relaxes_when_the_target_goes_on_as_the_draft_does() -> None:
    # Position 0 is a close call and the draft takes the runner-up (1); the target's top-1 at position 1
    # (scored after that token) is 3, which is the draft's next token: the guard lets it relax.
    out = verify_greedy(rows(CLOSE, BONUS, BONUS), tok(1, 3), NEXT)
    assert (out.n_accepted, out.next_token, out.relaxed.tolist()) == (2, 3, [True, False])


def test_next_guard_refuses_when_the_target_disagrees_with_the_next_draft_token() -> None:
    out = verify_greedy(rows(CLOSE, BONUS, BONUS), tok(1, 2), NEXT)
    assert (out.n_accepted, out.next_token) == (0, 0)  # strict's correction
    unguarded = verify_greedy(rows(CLOSE, BONUS, BONUS), tok(1, 2), MARS)
    assert unguarded.n_accepted == 1 and unguarded.relaxed.tolist() == [True]


def test_next_guard_never_relaxes_the_last_draft_position() -> None:
    out = verify_greedy(rows(CLOSE, BONUS), tok(1), NEXT)
    assert (out.n_accepted, out.next_token) == (0, 0)
    # exact matches are untouched by the guard
    assert verify_greedy(rows(CLOSE, BONUS), tok(0), NEXT).n_accepted == 1


def test_next_guard_under_sampling() -> None:
    gen = torch.Generator().manual_seed(0)
    guarded = verify_sampling(rows(CLOSE, BONUS, BONUS), tok(1, 3), None, NEXT, 1.0, gen)
    assert guarded.relaxed.tolist()[:1] == [True]
    for seed in range(20):  # disagreeing next token: position 0 is an ordinary (random) test, never relaxed
        out = verify_sampling(
            rows(CLOSE, BONUS, BONUS), tok(1, 2), None, NEXT, 1.0, torch.Generator().manual_seed(seed)
        )
        assert not out.relaxed.any()


def test_guard_is_validated_and_refused_on_trees() -> None:
    with pytest.raises(MarspecError, match="unknown guard"):
        Rule("mars", 0.9, "logit_ratio", guard="maybe")
    from marspec.decode import DecodeConfig

    with pytest.raises(MarspecError, match="chains, not token trees"):
        DecodeConfig(rule=NEXT, k=4, max_new_tokens=8, tree=(2, 2))


# ------------------------------------------------------------------------------------- Rival rules

# A row whose distribution is p = [0.5, 0.3, 0.15, 0.05]: entropy 1.1422 nats, exp(-H) = 0.3191.
SPREAD_P = [0.5, 0.3, 0.15, 0.05]
SPREAD = [math.log(x) for x in SPREAD_P]
SPREAD_H = -sum(x * math.log(x) for x in SPREAD_P)


@pytest.mark.parametrize(
    ("rule", "theta"),
    [
        ("typical", 1.5),
        ("typical", -0.1),
        ("typical", float("nan")),
        ("pthresh", 1.1),
        ("pthresh", -0.5),
        ("topk", 0),
        ("topk", 2.5),
        ("topk", float("inf")),
        ("topk", True),
    ],
)
def test_rival_parameters_are_validated(rule: str, theta: object) -> None:
    with pytest.raises(MarspecError, match=f"invalid for rule '{rule}'"):
        Rule(rule, theta)  # type: ignore[arg-type]


def test_rivals_take_no_next_guard() -> None:
    with pytest.raises(MarspecError, match="'next' guard is MARS's"):
        Rule("topk", 2, guard="next")


@pytest.mark.parametrize(
    ("eps", "accepted"),
    # eps 0.09: threshold min(0.09, 0.3 * 0.319) = 0.09, so p = 0.3 and 0.15 pass, 0.05 does not.
    # eps 0.25: threshold min(0.25, 0.5 * 0.319) = 0.160 (the entropy side), so only p = 0.3 passes.
    [(0.09, {1: True, 2: True, 3: False}), (0.25, {1: True, 2: False, 3: False})],
)
def test_typical_acceptance_threshold_shrinks_with_entropy(eps: float, accepted: dict[int, bool]) -> None:
    threshold = min(eps, math.sqrt(eps) * math.exp(-SPREAD_H))
    for token, expected in accepted.items():
        assert (SPREAD_P[token] > threshold) is expected  # the hand computation agrees with the table
        out = verify_greedy(rows(SPREAD, BONUS), tok(token), Rule("typical", eps))
        assert (out.n_accepted, out.n_relaxed) == ((1, 1) if expected else (0, 0)), token
        assert out.next_token == (3 if expected else 0)  # the bonus, or the target's top-1


def test_pthresh_accepts_at_or_above_its_probability() -> None:
    assert verify_greedy(rows(SPREAD, BONUS), tok(1), Rule("pthresh", 0.299)).n_relaxed == 1  # p = 0.3
    assert verify_greedy(rows(SPREAD, BONUS), tok(1), Rule("pthresh", 0.31)).n_accepted == 0
    assert verify_greedy(rows(SPREAD, BONUS), tok(2), Rule("pthresh", 0.1)).n_relaxed == 1


def test_topk_accepts_a_draft_among_the_top_k() -> None:
    assert verify_greedy(rows(SPREAD, BONUS), tok(2), Rule("topk", 3)).n_relaxed == 1  # third of four
    assert verify_greedy(rows(SPREAD, BONUS), tok(2), Rule("topk", 2)).n_accepted == 0
    assert verify_greedy(rows(SPREAD, BONUS), tok(1), Rule("topk", 2)).n_relaxed == 1
    out = verify_greedy(rows(SPREAD, SPREAD, BONUS), tok(0, 3), Rule("topk", 3))
    assert (out.n_accepted, out.n_relaxed, out.next_token) == (1, 0, 0)  # exact, then 4th of 4: rejected


@pytest.mark.parametrize("rule", [Rule("typical", 0.0), Rule("pthresh", 1.0), Rule("topk", 1)])
def test_rivals_at_their_no_relax_settings_equal_strict(rule: Rule) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        logits = torch.randn(4, VOCAB, generator=gen) * 2
        draft = torch.randint(0, VOCAB, (3,), generator=gen)
        ours, strict = verify_greedy(logits, draft, rule), verify_greedy(logits, draft, STRICT)
        assert (ours.n_accepted, ours.next_token, ours.n_relaxed) == (strict.n_accepted, strict.next_token, 0)


def test_sampling_rival_accepts_without_a_draw_where_its_test_passes() -> None:
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0]])  # q(1) = 1 > p(1) = 0.3: a lossless test rejects 70% of draws
    for seed in range(50):
        gen = torch.Generator().manual_seed(seed)
        out = verify_sampling(rows(SPREAD, BONUS), tok(1), q, Rule("pthresh", 0.25), 1.0, gen)
        assert (out.n_accepted, out.n_relaxed) == (1, 1)
    # At temperature 3 the distribution flattens (p(1) = 0.283 < 0.29): the rival's test fails there.
    rejected = 0
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        out = verify_sampling(rows(SPREAD, BONUS), tok(1), q, Rule("pthresh", 0.29), 3.0, gen)
        assert out.n_relaxed == 0
        rejected += out.n_accepted == 0
    assert rejected > 100  # the lossless test decided instead
