"""Shared fixtures: tiny random-weight models for fast loop tests, the small benchmark configuration the
bench tests share, and the real default pair's loaded forms (fp32, int8 and int4 targets), each loaded
once per session for the real-weights modules that use them."""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from marspec import Decoder
from marspec.backends.hf import HFCausalLM
from marspec.decode import DecodeConfig, decode
from marspec.defaults import DEFAULT_DRAFT_CONFIDENCE, DEFAULT_DRAFT_QUANT, DEFAULT_LOOKUP
from marspec.eval.bench import BenchConfig
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET
from marspec.models.cache import cache_dir
from marspec.rules import Rule
from marspec.stats import GenerationStats

# The suite decodes with the fixed draft length and stop (k 8, stop 0.55) its expectations were written
# for, on every machine; tests of the choice made from measured costs turn it on for themselves.
os.environ["MARSPEC_DRAFT_COSTS"] = "off"

TINY_VOCAB = 97
SMALL = "smollm2-135m-instruct"
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_module(name: str) -> ModuleType:
    """The script benchmarks/<name>.py as a module, imported as the scripts import each other (their
    folder on the path, for its shared helpers)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


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


# The tiny models' sizes, shared by every architecture the tests build (a layer count of their own).
TINY_SIZES: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def tiny_lm(seed: int, name: str = "tiny", layers: int = 2, **config_changes: Any) -> HFCausalLM:
    """A random 2-layer Qwen2 with a 97-token vocabulary, fp32, no tokenizer (loop tests use ids);
    ``config_changes`` override its Qwen2Config."""
    torch.manual_seed(seed)
    config = Qwen2Config(**TINY_SIZES, num_hidden_layers=layers, tie_word_embeddings=False, **config_changes)
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


# The real-weights modules that share the loaded pairs below, in the order they run: after every other test
# (a failure in the fast tests shows first, and the shared models take memory only while they are used),
# the EAGLE-3 module last because a head keeps hooks on the fp32 target's layers.
REAL_MODULES = ("test_real.py", "test_real_fixed.py", "test_eagle3_real.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def place(item: pytest.Item) -> int:
        name = item.path.name
        return REAL_MODULES.index(name) + 1 if name in REAL_MODULES else 0

    items.sort(key=place)  # stable: each module's own order is kept


# Each load of the fp32 pair costs CI ~30 s and each quantised target more (quantising, or reading the
# GGUF); the eager and the fixed-shape tests of each target share one load.
@pytest.fixture(scope="session")
def fp32_pair() -> Decoder:
    """The default pair in fp32, the target's linear layers oneDNN-prepacked (the default kernels). The
    draft in int8: the draft whose proposals the tests' "it relaxed at least once" checks were written
    against (with the 4-bit default draft, MARS 0.9 under the class guard relaxed nothing in 48 tokens)."""
    return Decoder(DEFAULT_TARGET, DEFAULT_DRAFT, dtype="fp32", draft_quant="int8")


@pytest.fixture(scope="session")
def gguf_only_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache of its own for the real pairs on the CPU engines, its models as fresh as a new
    user's. Its kernels are the session's cache's (a link): the processes that force another kernel path
    on it would otherwise build that path's library again (~30 s each), which the fast tests test."""
    cache = tmp_path_factory.mktemp("gguf-only-cache")
    kernels = cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(kernels, target_is_directory=True)
    return cache


@pytest.fixture(scope="session")
def default_pair(gguf_only_cache: Path) -> Decoder:
    """The default pair as a CPU user gets it when naming no precision (the q4k target where the Q4_K
    kernel runs, else the int8 one, and a 4-bit draft), loaded as a new user's cache loads them, straight
    from the packaged GGUFs into :func:`gguf_only_cache` (no float32 weights written)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MARSPEC_CACHE_DIR", str(gguf_only_cache))
        return Decoder(DEFAULT_TARGET, DEFAULT_DRAFT)


@pytest.fixture(scope="session")
def int8_pair(gguf_only_cache: Path) -> Decoder:
    """The default pair on the int8 engine with torch's 4-bit draft (the defaults where the Q4_K kernel
    does not run), straight from the packaged GGUFs into :func:`gguf_only_cache`."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MARSPEC_CACHE_DIR", str(gguf_only_cache))
        return Decoder(DEFAULT_TARGET, DEFAULT_DRAFT, target_quant="int8", draft_quant="int4")


@pytest.fixture(scope="session")
def int4_pair(gguf_only_cache: Path) -> Decoder:
    """The default pair in 4 bits, target and draft, loaded as a new user's cache loads it: straight from
    the packaged GGUFs into :func:`gguf_only_cache` (no float32 weights written)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MARSPEC_CACHE_DIR", str(gguf_only_cache))
        return Decoder(DEFAULT_TARGET, DEFAULT_DRAFT, dtype="fp32", target_quant="int4", draft_quant="int4")
