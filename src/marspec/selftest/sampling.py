"""Speculative sampling is lossless: a chi-square test through the whole decode loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from marspec.backends.hf import HFCausalLM

from marspec.selftest.report import Check
from marspec.selftest.tiny import tiny_model

# The sampling check: a 4-token vocabulary, the joint distribution of the first two emitted tokens (16
# cells), sampled TRIALS times at a temperature far from 1. CHI2_999_15 is the chi-square 0.999 quantile
# for 15 degrees of freedom: a correct sampler fails one run in a thousand (the seeds are fixed). Its
# power, measured: a drafter reporting its distribution at temperature 1 instead of 0.25 scored 89 (the
# correct one 5); at 0.5 the same bug scored 25 and went unseen (tests/test_selftest.py).
SAMPLING_VOCAB = 4
SAMPLING_TOKENS = 2
SAMPLING_TEMPERATURE = 0.25
TRIALS = 800
CHI2_999_15 = 37.697


def sampling_is_lossless(device: torch.device, trials: int = TRIALS) -> Check:
    """Strict speculative sampling through the decode loop reproduces the target's distribution."""
    from marspec.backends.hf import HFCausalLM
    from marspec.drafters.model import ModelDrafter

    name = "speculative sampling is lossless"
    # A spread-out target (every cell is seen) and a sharper, different draft (rejections and residual
    # draws are common), over a 4-token vocabulary.
    target = HFCausalLM(small_model(seed=0, sharpen=1.0).to(device), None, "small-target")
    draft = HFCausalLM(small_model(seed=1, sharpen=3.0).to(device), None, "small-draft")
    prompt = torch.tensor([1, 3, 0, 2], dtype=torch.long, device=device)
    probs = target_joint(target, prompt)
    counts = sampled_counts(target, ModelDrafter(draft, SAMPLING_VOCAB), prompt, trials)
    stat = chi_square(counts, probs)
    least = float(probs.min()) * trials
    detail = (
        f"chi-square {stat:.1f} over {probs.numel()} cells ({trials} samples, at least {least:.0f} "
        f"expected per cell); fails above {CHI2_999_15} (p = 0.001)"
    )
    return Check(name, stat < CHI2_999_15, detail)


def small_model(seed: int, sharpen: float) -> PreTrainedModel:
    # transformers' default spread (0.02): smooth distributions, so every cell is expected often.
    return tiny_model(seed, vocab_size=SAMPLING_VOCAB, layers=1, hidden=16, sharpen=sharpen, init_std=0.02)


def target_joint(target: HFCausalLM, prompt: torch.Tensor) -> torch.Tensor:
    """The target's exact distribution of its first SAMPLING_TOKENS tokens after ``prompt`` at
    SAMPLING_TEMPERATURE, float64 [V**SAMPLING_TOKENS] on the host, from one forward per prefix."""

    def next_dist(prefix: torch.Tensor) -> torch.Tensor:
        target.reset()
        logits = target.forward(prefix, last_only=True)[-1]
        return torch.softmax(logits.double().cpu() / SAMPLING_TEMPERATURE, dim=-1)

    joint = torch.ones(1, dtype=torch.float64)
    prefixes = [prompt]
    for _ in range(SAMPLING_TOKENS):
        dists = torch.stack([next_dist(p) for p in prefixes])  # [prefixes, V]
        joint = (joint[:, None] * dists).flatten()
        vocab = torch.arange(SAMPLING_VOCAB, device=prompt.device)
        prefixes = [torch.cat((p, t.view(1))) for p in prefixes for t in vocab]
    target.reset()
    return joint


def sampled_counts(target: HFCausalLM, drafter: Any, prompt: torch.Tensor, trials: int) -> torch.Tensor:
    """How often each joint outcome of the first SAMPLING_TOKENS tokens came out of ``trials`` strict
    speculative-sampling decodes (seeds 0 .. trials - 1), float64 [V**SAMPLING_TOKENS]."""
    from marspec.decode import DecodeConfig, decode
    from marspec.rules import Rule
    from marspec.stats import GenerationStats

    config = DecodeConfig(
        rule=Rule(name="strict"),
        k=2,
        temperature=SAMPLING_TEMPERATURE,
        max_new_tokens=SAMPLING_TOKENS,
        reuse_prefix=False,
    )
    counts = torch.zeros(SAMPLING_VOCAB**SAMPLING_TOKENS, dtype=torch.float64)
    for seed in range(trials):
        generator = torch.Generator(device=prompt.device).manual_seed(seed)
        tokens: list[int] = []
        for step in decode(target, drafter, prompt, config, GenerationStats(), generator):
            tokens.extend(step.tokens)
        cell = 0
        for token in tokens[:SAMPLING_TOKENS]:
            cell = cell * SAMPLING_VOCAB + token
        counts[cell] += 1
    return counts


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of observed ``counts`` against the distribution ``probs`` (same shape)."""
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())
