"""The vLLM tests run in vLLM's own environment (``make test-vllm``), on real checkpoints given by path."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from engine_ram import PAIR_ENGINE_GIB, SMALL_ENGINE_GIB, require_free_ram

# The library tests' EAGLE-3 head builder (tests/eagle3_heads.py) builds this folder's heads too. Appended,
# not prepended: a module name both folders use (test_eagle3) still means this folder's.
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))

# vLLM's V2 verifier runs under Triton's interpreter, which must not reach the other tests' processes:
# `make test-vllm` runs that folder in a pytest process of its own.
collect_ignore = ["interpreted"]


def checkpoint(variable: str) -> str:
    """A checkpoint directory from the environment; ``make test-vllm`` sets both variables."""
    path = os.environ.get(variable)
    if not path or not os.path.isdir(path):
        pytest.fail(
            f"{variable} must name a Hugging Face checkpoint directory (got {path!r}); "
            f"`make test-vllm` converts the default models and sets it"
        )
    return path


@pytest.fixture(scope="session")
def target_dir() -> str:
    return checkpoint("MARSPEC_VLLM_TARGET")


@pytest.fixture(scope="session")
def draft_dir() -> str | None:
    """The draft checkpoint, or None for vLLM's n-gram drafting (``MARSPEC_VLLM_DRAFT=ngram``)."""
    if os.environ.get("MARSPEC_VLLM_DRAFT") == "ngram":
        return None
    return checkpoint("MARSPEC_VLLM_DRAFT")


@pytest.fixture(scope="session")
def free_ram(draft_dir: str | None) -> None:
    """Enough RAM free for the pair's engines (target and draft weights plus the KV cache), checked once."""
    require_free_ram(PAIR_ENGINE_GIB if draft_dir else SMALL_ENGINE_GIB)
