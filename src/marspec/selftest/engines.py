"""The engines keep the invariants: on the CPU's q4k and int8 engines (the default on a CPU for a model that
comes as a GGUF) strict equals plain and rules that cannot relax equal strict, token for token; and sequences
decoded together (continuous batching) decode what each decodes alone."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from marspec.backends.int8 import rowwise_int8_available
from marspec.backends.kernels import kernels_available
from marspec.selftest.equality import (
    NEW_TOKENS,
    PROMPTS,
    K,
    compare_runs,
    no_relax_equals_strict,
    strict_equals_plain,
)
from marspec.selftest.report import Check
from marspec.selftest.tiny import tiny_decoder

if TYPE_CHECKING:
    from marspec.api import Decoder

INT8_CHECK = "int8 engine: strict == plain, no-relax rules == strict"


def int8_engine_keeps_the_invariants(folder: Path, device: torch.device) -> Check | None:
    """Both equalities on the tiny pair with its target on the int8 engine (row-wise int8 linear layers,
    int8 embedding, attention row by row); None where that engine cannot run (another device, or a CPU
    without an int8 dot product)."""
    if device.type != "cpu" or not rowwise_int8_available():
        return None
    return _engine_check(INT8_CHECK, tiny_decoder(folder, device, target_quant="int8"))


Q4K_CHECK = "q4k engine: strict == plain, no-relax rules == strict"


def q4k_engine_keeps_the_invariants(folder: Path, device: torch.device) -> Check | None:
    """Both equalities on the tiny pair with target and draft on the Q4_K kernel (every linear layer's
    weights quantised to Q4_K, int8 activation rows, attention row by row); None where the kernel does
    not run (another device, or a CPU or build without it)."""
    if device.type != "cpu" or not kernels_available():
        return None
    return _engine_check(Q4K_CHECK, tiny_decoder(folder, device, target_quant="q4k"))


def _engine_check(name: str, decoder: Decoder) -> Check:
    """Strict == plain and no-relax rules == strict on ``decoder``, as one check named ``name``."""
    checks = (strict_equals_plain(decoder), no_relax_equals_strict(decoder))
    failed = [c for c in checks if not c.passed]
    if failed:
        return Check(name, False, f"{failed[0].name}: {failed[0].detail}")
    return Check(name, True, "; ".join(c.detail for c in checks))


BATCH_CHECK = "batch: each sequence decodes as it does alone"
# One prompt's own settings each, inside one batch: greedy rules, a relaxing MARS, seeded sampling.
_BATCH_SETTINGS = (
    {"rule": "plain"},
    {"rule": "strict"},
    {"rule": "mars", "theta": 0.3},
    {"rule": "mars", "theta": 0.3, "temperature": 1.0, "seed": 3},
)


def batch_decodes_as_alone(folder: Path, device: torch.device) -> Check:
    """Four prompts, each with its own rule, decoded two at a time (the later ones joining as earlier
    ones finish) against each decoded alone, token for token: on a CPU with int8 kernels the tiny pair
    on the int8 engine, whose forwards are packed together; elsewhere its float model, whose forwards
    take turns."""
    int8 = device.type == "cpu" and rowwise_int8_available()
    decoder = tiny_decoder(folder, device, target_quant="int8" if int8 else "none")
    engine = "int8, packed" if int8 else f"{decoder.target_weights}, in turn"
    return _decoded_as_alone(BATCH_CHECK, decoder, engine)


FIXED_BATCH_CHECK = "fixed-shape batch: each sequence decodes as it does alone"


def fixed_batch_decodes_as_alone(folder: Path, device: torch.device) -> Check:
    """The same on the fixed-shape path, whose sequences share batched forwards (captured as CUDA graphs
    per batch bucket on a GPU): the tiny float pair's answers, two at a time, against each alone."""
    decoder = tiny_decoder(folder, device, graphs="on")
    engine = f"{decoder.target_weights}, batched forwards" + (", CUDA graphs" if decoder.captured else "")
    return _decoded_as_alone(FIXED_BATCH_CHECK, decoder, engine)


def _decoded_as_alone(name: str, decoder: Decoder, engine: str) -> Check:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(_BATCH_SETTINGS))]
    shared = {"max_new_tokens": NEW_TOKENS, "k": K, "chat": False}
    alone = [decoder.generate(p, **shared, **s) for p, s in zip(prompts, _BATCH_SETTINGS, strict=True)]
    with _quiet("marspec.batch"):  # its note (answers may round by the batch) is what this check tests
        together = decoder.generate_many(prompts, max_batch=2, per_prompt=list(_BATCH_SETTINGS), **shared)
    runs = [
        (f"prompt {i + 1}, {' '.join(f'{k}={v}' for k, v in s.items())}", a.token_ids, t.token_ids)
        for i, (s, a, t) in enumerate(zip(_BATCH_SETTINGS, alone, together, strict=True))
    ]
    check = compare_runs(name, runs)
    return Check(name, check.passed, f"{check.detail} ({engine})")


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """``logger``'s warnings held back for the duration (restored after)."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)
