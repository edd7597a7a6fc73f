"""Speculative sampling through the whole loop is lossless: drafter, verifier and cache discipline together.

tests/test_verify.py checks ``verify_sampling`` on made-up draft distributions (tests/test_block.py
block verification's). Here real (tiny, random)
models go through ``decode()``: the draft model samples its tokens and hands the verifier the
distribution it sampled from. If that hand-over were wrong (for example q recorded at temperature 1
while sampling at another), strict speculative sampling would no longer reproduce the target's
distribution; the chi-square test below would see it, and a test of the test makes sure it does.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from marspec.backends.hf import HFCausalLM
from marspec.decode import DecodeConfig, decode
from marspec.drafters.model import ModelDrafter
from marspec.rules import Rule
from marspec.stats import GenerationStats

VOCAB = 4
TEMPERATURE = 0.4  # far from 1, so a q recorded at temperature 1 is far from the real one
TOKENS = 3  # the joint distribution of the first three new tokens: VOCAB**3 = 64 cells
TRIALS = 1500
CHI2_999_63 = 103.442  # chi-square 0.999 quantile, 63 degrees of freedom
PROMPT = torch.tensor([1, 3, 0, 2], dtype=torch.long)


def small_lm(seed: int, spread: float) -> HFCausalLM:
    """A random 1-layer Qwen2 over 4 tokens whose next-token distribution depends on the prefix."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval().requires_grad_(False)
    model.lm_head.weight.mul_(spread)  # how peaked the model's distributions are
    return HFCausalLM(model, tokenizer=None, name=f"small-{seed}")


@pytest.fixture(scope="module")
def target() -> HFCausalLM:
    return small_lm(0, spread=1.0)  # spread out at T = 0.4: every one of the 64 cells gets samples


@pytest.fixture(scope="module")
def draft() -> HFCausalLM:
    return small_lm(1, spread=3.0)  # sharper and different: rejections and residual draws are common


def target_joint(target: HFCausalLM) -> torch.Tensor:
    """The target's exact distribution of the first TOKENS new tokens at TEMPERATURE, [VOCAB**3]."""

    def next_dist(prefix: list[int]) -> torch.Tensor:
        target.reset()
        logits = target.forward(torch.tensor(prefix, dtype=torch.long), last_only=True)[-1]
        return torch.softmax(logits.double() / TEMPERATURE, dim=-1)

    base = PROMPT.tolist()
    p1 = next_dist(base)
    joint = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for x in range(VOCAB):
        p2 = next_dist([*base, x])
        for y in range(VOCAB):
            joint[x, y] = p1[x] * p2[y] * next_dist([*base, x, y])
    return joint.flatten()


def sampled_counts(target: HFCausalLM, drafter: ModelDrafter, rule: Rule, trials: int) -> torch.Tensor:
    config = DecodeConfig(rule=rule, k=2, temperature=TEMPERATURE, max_new_tokens=TOKENS)
    counts = torch.zeros(VOCAB**TOKENS, dtype=torch.float64)
    for seed in range(trials):
        tokens: list[int] = []
        for step in decode(
            target, drafter, PROMPT, config, GenerationStats(), torch.Generator().manual_seed(seed)
        ):
            tokens.extend(step.tokens)
        x, y, z = tokens[:TOKENS]
        counts[(x * VOCAB + y) * VOCAB + z] += 1
    return counts


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


class TemperatureOneDrafter(ModelDrafter):
    """A broken drafter: it samples at the run's temperature but reports q at temperature 1."""

    def propose(self, context, k, temperature, generator, alternatives=0):
        draft = super().propose(context, k, temperature, generator, alternatives)
        assert draft.probs is not None
        logits_t = draft.probs.clamp_min(1e-30).log()  # log q_T = z / T + c
        wrong = torch.softmax(logits_t * temperature, dim=-1)  # q at temperature 1
        return type(draft)(tokens=draft.tokens, probs=wrong, alternatives=draft.alternatives)


# Strict speculative sampling and block verification (Sun et al. 2024), both lossless.
LOSSLESS = pytest.mark.parametrize("rule", ["strict", "block"])


@LOSSLESS
def test_lossless_speculative_sampling_through_decode_matches_the_target(target, draft, rule):
    joint = target_joint(target)
    assert float(joint.min()) * TRIALS > 2  # every cell is expected to be seen
    counts = sampled_counts(target, ModelDrafter(draft, VOCAB), Rule(name=rule), TRIALS)
    assert chi2(counts, joint) < CHI2_999_63


@LOSSLESS
def test_the_chi_square_test_catches_a_drafter_that_misreports_q(target, draft, rule):
    joint = target_joint(target)
    counts = sampled_counts(target, TemperatureOneDrafter(draft, VOCAB), Rule(name=rule), TRIALS)
    assert chi2(counts, joint) > CHI2_999_63


def test_draft_probs_are_the_distribution_each_token_was_drawn_from(draft):
    """Draft.probs[i] must be softmax(draft logits / T) after context + tokens[:i], the very distribution
    tokens[i] was sampled from, recomputed here from scratch with the draft model."""
    drafter = ModelDrafter(draft, VOCAB)
    for seed in range(5):
        drafter.reset()
        proposal = drafter.propose(PROMPT, 4, TEMPERATURE, torch.Generator().manual_seed(seed))
        assert proposal.probs is not None and len(proposal) == 4
        for i in range(len(proposal)):
            draft.reset()
            context = torch.cat([PROMPT, proposal.tokens[:i]])
            expected = torch.softmax(draft.forward(context, last_only=True)[-1] / TEMPERATURE, dim=-1)
            torch.testing.assert_close(proposal.probs[i], expected, rtol=1e-5, atol=1e-6)
            assert float(proposal.probs[i, proposal.tokens[i]]) > 0
