"""Shared fixtures: tiny random-weight models for fast loop tests (real weights are in test_real.py), and
the small benchmark configuration the bench tests share."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from marspec.backends.hf import HFCausalLM
from marspec.decode import DecodeConfig, decode
from marspec.defaults import DEFAULT_DRAFT_CONFIDENCE, DEFAULT_DRAFT_QUANT, DEFAULT_LOOKUP
from marspec.eval.bench import BenchConfig
from marspec.rules import Rule
from marspec.stats import GenerationStats

TINY_VOCAB = 97
SMALL = "smollm2-135m-instruct"


def bench_config(methods: str, **changes: Any) -> BenchConfig:
    """A GSM8K bench on SmolLM2 drafting for itself, 12 new tokens, k = 3, one thread."""
    config = BenchConfig(
        task="gsm8k",
        methods=tuple(methods.split(",")),
        theta=0.9,
        margin="logit_ratio",
        k=3,
        max_new_tokens=12,
        target=SMALL,
        draft=SMALL,
        draft_quant=DEFAULT_DRAFT_QUANT,
        draft_confidence=DEFAULT_DRAFT_CONFIDENCE,
        lookup=DEFAULT_LOOKUP,
        dtype="fp32",
        threads=1,
    )
    return replace(config, **changes)


def tiny_lm(seed: int, name: str = "tiny", layers: int = 2, **config_changes: Any) -> HFCausalLM:
    """A random 2-layer Qwen2 with a 97-token vocabulary, fp32, no tokenizer (loop tests use ids);
    ``config_changes`` override its Qwen2Config."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **config_changes,
    )
    model = Qwen2ForCausalLM(config).eval().requires_grad_(False)
    # Sharpen the random logits so greedy choices are not decided by float noise.
    model.lm_head.weight.mul_(20.0)
    return HFCausalLM(model, tokenizer=None, name=name)


def decode_tokens(target, drafter, prompt, **config) -> tuple[list[int], GenerationStats]:
    """Run the decode loop with ``DecodeConfig(**config)``: the tokens it emitted and its statistics."""
    stats = GenerationStats()
    tokens: list[int] = []
    config = DecodeConfig(**{"rule": Rule(), "k": 1, **config})  # plain decoding reads neither
    for step in decode(target, drafter, prompt, config, stats):
        tokens += step.tokens
    return tokens, stats


def assert_chain_rows_scored_as_one_token_forwards(lm: HFCausalLM, prompt: torch.Tensor) -> None:
    """The property strict == plain rests on for a quantised target: a forward over several new tokens
    scores each exactly (bit for bit, attention included) as one-token forwards do, and a prompt scored
    in one forward caches what scoring it in pieces caches (prefix reuse's premise)."""
    lm.forward(prompt[:3])
    together = lm.forward(prompt[3:])  # [len - 3, V]
    lm.reset()
    lm.forward(prompt[:3])
    one_by_one = torch.cat([lm.forward(prompt[i : i + 1]) for i in range(3, len(prompt))])
    assert torch.equal(together, one_by_one)
    lm.reset()
    assert torch.equal(lm.forward(prompt)[3:], together)


@pytest.fixture
def target() -> HFCausalLM:
    return tiny_lm(0, "tiny-target")


@pytest.fixture
def prompt() -> torch.Tensor:
    return torch.tensor([5, 17, 42, 8, 63, 5, 17, 42], dtype=torch.long)
