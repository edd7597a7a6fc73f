"""The ensemble rule (DIVERSED's static ensemble, arXiv 2604.07622; transformers'
``assistant_ensemble_weight``): verify against ``theta * p + (1 - theta) * q``. Every branch on
hand-made probabilities, greedy and sampling; theta 1 equals strict; the drafter's distribution under
greedy drafting; its refusals. Bad settings through every layer are in tests/test_rules.py."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_lm

from marspec.decode import DecodeConfig, decode
from marspec.drafters import ModelDrafter, NgramDrafter
from marspec.errors import MarspecError
from marspec.rules import Rule
from marspec.settings import GenerationOptions, Pair, settle, settle_rule
from marspec.stats import GenerationStats
from marspec.thinking import ThinkingMarkers
from marspec.verify import ensemble_choices, verify_greedy, verify_sampling

HALF = Rule("ensemble", 0.5)


def logits_of(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log().float()


def probs(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def tok(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


# Row 0: the target prefers 0 a little over 1, and the draft is sure of 1. Row 1 is the bonus row.
NEAR_TIE = logits_of([0.5, 0.4, 0.1], [0.1, 0.1, 0.8])
SURE_OF_1 = probs([0.0, 1.0, 0.0])


def test_greedy_accepts_the_mixtures_argmax() -> None:
    # v = 0.5 * [0.5, 0.4, 0.1] + 0.5 * [0, 1, 0] = [0.25, 0.7, 0.05]: the draft's 1 is accepted, relaxed.
    result = verify_greedy(NEAR_TIE, tok(1), HALF, draft_probs=SURE_OF_1)
    assert (result.n_accepted, result.next_token, result.relaxed.tolist()) == (1, 2, [True])
    assert result.top1.tolist() == [0]  # the target's choice it replaced
    # With more weight on the target, v = [0.45, 0.46, 0.09] still; at 0.9 it is [0.45, 0.46, ...].
    assert verify_greedy(NEAR_TIE, tok(1), Rule("ensemble", 0.95), draft_probs=SURE_OF_1).n_accepted == 0


def test_greedy_corrects_with_the_mixtures_argmax_and_takes_the_bonus_from_the_target() -> None:
    # v = 0.5 * [0.5, 0.05, 0.45] + 0.5 * [0, 0.6, 0.4] = [0.25, 0.325, 0.425]: neither the draft's 1 nor
    # the target's 0. The draft is rejected and the mixture's 2 emitted.
    logits = logits_of([0.5, 0.05, 0.45], [0.1, 0.1, 0.8])
    result = verify_greedy(logits, tok(1), HALF, draft_probs=probs([0.0, 0.6, 0.4]))
    assert (result.n_accepted, result.next_token, result.n_relaxed) == (0, 2, 0)
    choices = ensemble_choices(logits, probs([0.0, 0.6, 0.4]), logits.argmax(-1), HALF)
    assert choices.tolist() == [2, 2]  # row 1, the bonus row, is the target's argmax (no q there)


def test_a_draft_without_a_distribution_is_verified_strictly() -> None:
    # A lookup drafter's copy: the mixture would be one-hot at whatever was copied.
    assert verify_greedy(NEAR_TIE, tok(1), HALF, draft_probs=None).emitted() == [0]
    strict = [verify_sampling(NEAR_TIE, tok(1), None, Rule(), 1.0, g).emitted() for g in _seeds(20)]
    assert [verify_sampling(NEAR_TIE, tok(1), None, HALF, 1.0, g).emitted() for g in _seeds(20)] == strict


def test_weight_one_is_strict_token_for_token() -> None:
    def seen(result) -> tuple[list[int], list[bool]]:
        return result.emitted(), result.relaxed.tolist()

    one = Rule("ensemble", 1.0)
    assert not one.relaxes
    torch.manual_seed(0)
    for _ in range(20):
        logits = torch.randn(5, 7) * 3
        q = torch.softmax(torch.randn(4, 7) * 3, -1)
        draft = torch.multinomial(q, 1)[:, 0]
        assert seen(verify_greedy(logits, draft, one, draft_probs=q)) == seen(
            verify_greedy(logits, draft, Rule())
        )
        for g, h in zip(_seeds(3), _seeds(3), strict=True):
            ours = verify_sampling(logits, draft, q, one, 0.8, g)
            assert seen(ours) == seen(verify_sampling(logits, draft, q, Rule(), 0.8, h))


def _seeds(n: int):
    return (torch.Generator().manual_seed(s) for s in range(n))


def test_sampling_emits_the_mixture_at_the_first_position() -> None:
    """Speculative sampling against v makes the first token v-distributed: accepted d with probability
    q(d) min(1, v(d)/q(d)), else drawn from norm(max(0, v - q)) = norm(max(0, p - q))."""
    p = torch.tensor([0.6, 0.3, 0.1, 0.0])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = torch.stack([p, torch.tensor([0.25] * 4)]).log()
    theta = 0.4
    mixture = theta * p + (1 - theta) * q
    counts = torch.zeros(4)
    draws = torch.Generator().manual_seed(1)
    trials = 4000
    for seed in range(trials):
        draft = torch.multinomial(q, 1, generator=draws)
        result = verify_sampling(
            logits, draft, q[None], Rule("ensemble", theta), 1.0, torch.Generator().manual_seed(seed)
        )
        counts[result.emitted()[0]] += 1
    expected = mixture * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27  # chi-square 0.999 quantile, 3 degrees of freedom
    target = p.clamp(min=1e-3) * trials  # against the target itself it fails (token 3 has p = 0)
    assert float(((counts - target) ** 2 / target).sum()) > 16.27


def test_sampling_counts_as_relaxed_what_only_the_mixture_accepts() -> None:
    # p(d) / q(d) = 0.4 / 1 = 0.4; v(d) / q(d) = 0.5 + 0.5 * 0.4 = 0.7: uniforms in [0.4, 0.7) are relaxed.
    for g in _seeds(60):
        u = float(torch.rand(2, generator=torch.Generator().manual_seed(g.initial_seed()))[0])
        result = verify_sampling(NEAR_TIE, tok(1), SURE_OF_1, HALF, 1.0, g)
        assert result.n_accepted == (u < 0.7) and result.n_relaxed == (0.4 <= u < 0.7)


def test_the_thinking_guard_keeps_the_target_outside_its_span() -> None:
    markers = ThinkingMarkers(start=5, end=6)
    guard = Rule("ensemble", 0.5, guard="thinking")
    logits = torch.cat([NEAR_TIE, torch.full((2, 4), -1e9)], dim=1)  # 7 tokens, the markers never likely
    q = torch.cat([SURE_OF_1, torch.zeros(1, 4)], dim=1)
    inside = verify_greedy(logits, tok(1), guard, draft_probs=q, span=markers.span(tok(1), True))
    outside = verify_greedy(logits, tok(1), guard, draft_probs=q, span=markers.span(tok(1), False))
    assert inside.emitted() == [1, 2] and inside.n_relaxed == 1
    assert outside.emitted() == [0] and outside.n_relaxed == 0


def test_the_ensemble_is_refused_where_it_cannot_apply() -> None:
    with pytest.raises(MarspecError, match="rule 'ensemble' needs theta"):
        settle_rule("ensemble")
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(MarspecError, match=r"use a weight in \(0, 1\]"):
            settle_rule("ensemble", bad)
    with pytest.raises(MarspecError, match="theta='auto' is MARS's"):
        settle_rule("ensemble", "auto")
    with pytest.raises(MarspecError, match="the 'class' guard does not apply to it; rule 'ensemble' takes"):
        Rule("ensemble", 0.5, guard="class")
    with pytest.raises(MarspecError, match="a tree's siblings have none: drop the tree"):
        GenerationOptions(rule="ensemble", theta=0.5, tree="2,2")
    options = GenerationOptions(rule="ensemble", theta=0.5)
    with pytest.raises(MarspecError, match=r"prompt lookup \(draft='ngram'\) has none"):
        settle(options, Pair(target="t", draft="ngram"))


def test_through_the_loop_weight_one_is_strict_and_a_lower_weight_relaxes(target, prompt) -> None:
    """Greedy drafting hands the verifier the draft's distribution at temperature 1 only when the
    ensemble asks (the drafter's ``distributions``)."""
    drafter = ModelDrafter(tiny_lm(2, "tiny-draft"), target_vocab_size=target.vocab_size)

    def run(rule: Rule, temperature: float = 0.0) -> tuple[list[int], int]:
        config = DecodeConfig(rule=rule, k=3, max_new_tokens=30, temperature=temperature)
        steps = list(
            decode(target, drafter, prompt, config, GenerationStats(), torch.Generator().manual_seed(0))
        )
        return [t for s in steps for t in s.tokens], sum(len(s.relaxed_at) for s in steps)

    strict, _ = run(Rule())
    assert run(Rule("ensemble", 1.0)) == (strict, 0)
    mixed, relaxed = run(Rule("ensemble", 0.3))
    assert relaxed > 0 and mixed != strict
    assert run(Rule("ensemble", 1.0), 0.7) == run(Rule(), 0.7)
    # Prompt lookup has no distribution: the ensemble verifies its drafts strictly.
    ngram_config = DecodeConfig(rule=Rule("ensemble", 0.3), k=3, max_new_tokens=30)
    steps = list(decode(target, NgramDrafter(), prompt, ngram_config, GenerationStats()))
    assert not any(s.relaxed_at for s in steps)


def test_a_greedy_drafter_returns_its_temperature_one_distribution_when_asked(prompt) -> None:
    lm = tiny_lm(2, "tiny-draft")
    drafter = ModelDrafter(lm, target_vocab_size=lm.vocab_size)
    plain = drafter.propose(prompt, 3, 0.0, None)
    drafter.reset()
    asked = drafter.propose(prompt, 3, 0.0, None, distributions=True)
    assert plain.probs is None and torch.equal(asked.tokens, plain.tokens)
    assert asked.probs is not None and torch.equal(asked.probs.argmax(-1), asked.tokens)
    lm.reset()
    first = torch.softmax(lm.forward(prompt, last_only=True)[-1], -1)
    torch.testing.assert_close(asked.probs[0], first)


@pytest.mark.parametrize("settings", [{"rule": "ensemble", "theta": 0.5}, {"rule": "block"}])
def test_the_vllm_plugin_refuses_what_its_forcing_scheme_cannot_carry(settings) -> None:
    from marspec.integrations.vllm.config import (
        VllmPluginConfigError,
        parse_plugin_config,
        parse_request_rule,
    )

    name = settings["rule"]
    with pytest.raises(VllmPluginConfigError, match=f"additional_config\\[\"marspec\"\\]: rule '{name}'"):
        parse_plugin_config({"marspec": settings})
    with pytest.raises(VllmPluginConfigError, match=f"extra_args\\[\"marspec\"\\]: rule '{name}'"):
        parse_request_rule({"marspec": settings})
