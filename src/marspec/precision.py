"""Which weights a target runs with when the caller names no precision: the one decision behind
``target_quant="auto"`` and ``dtype="auto"`` for the library, the CLI, the server and the bench.

On a CPU, a model that comes as a GGUF (a known model's packaged file, or a ``.gguf`` path) runs on the
CPU engine built straight from the GGUF without a float32 copy (:mod:`marspec.models.int8_store`),
int8 activations one scale per token row, so that a verification forward costs little more than a
one-token step, which is where speculative decoding pays. Where the Q4_K kernel runs (x86 with AVX-512
VNNI and a compiler, :mod:`marspec.backends.q4k`) the engine is ``"q4k"``: the GGUF's own Q4_K weights
(the model as published, read at 4.75 bits a weight), its other layers int8; elsewhere ``"int8"``:
every layer int8 rows (1.5x the bytes a step reads, a different rounding of the same model). Either way
strict verification equals plain decoding *of it*. A checkpoint in float safetensors (a folder or Hub
id) keeps its own precision, with a hint that names the int8 engine. Naming a dtype names a precision:
the target then stays a float model. Elsewhere (a GPU, a CPU without an int8 dot product, a model passed
in loaded) nothing changes: float32 weights as loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from marspec.backends.int8 import rowwise_int8_available
from marspec.backends.q4k import q4k_kernel_available
from marspec.models.registry import MODELS

AUTO = "auto"
# What "auto" means for a float target: float32, exact, on every device.
FLOAT_DTYPE = "fp32"


@dataclass(frozen=True)
class Precision:
    """A target's precision, chosen: ``target_quant`` ("none", "int8", "q4k" or "int4"), the ``dtype`` of what
    is not quantised, and a one-line ``hint`` for the user when a faster CPU engine was left unused."""

    target_quant: str
    dtype: str | torch.dtype
    hint: str | None = None


def comes_as_gguf(target: object) -> bool:
    """Whether ``target`` names a model whose weights come as a GGUF: a known model or a .gguf path."""
    if not isinstance(target, (str, os.PathLike)):
        return False
    name = os.fspath(target)
    return name in MODELS or name.lower().endswith(".gguf")


def choose_draft_quant(draft_quant: str, device: torch.device) -> str:
    """``draft_quant`` with ``"auto"`` replaced: on a CPU the cheapest one-token step it runs, the Q4_K
    kernel where it runs (the 0.5B Qwen's step ~2.5x cheaper than torch's 4-bit kernel's), else torch's
    4-bit weights; elsewhere "none" (a draft then runs in the target's dtype)."""
    if draft_quant != AUTO:
        return draft_quant
    if device.type != "cpu":
        return "none"
    return "q4k" if q4k_kernel_available() else "int4"


def choose_precision(
    target: object, target_quant: str, dtype: str | torch.dtype, device: torch.device
) -> Precision:
    """``target_quant`` and ``dtype`` with ``"auto"`` replaced by this module's choice (see its
    docstring); values the caller named are returned as they are, for the loader to check."""
    if target_quant != AUTO:
        return Precision(target_quant, FLOAT_DTYPE if dtype == AUTO else dtype)
    if dtype != AUTO or device.type != "cpu" or not isinstance(target, (str, os.PathLike)):
        return Precision("none", FLOAT_DTYPE if dtype == AUTO else dtype)
    if not rowwise_int8_available():
        return Precision("none", FLOAT_DTYPE)
    if comes_as_gguf(target):
        return Precision("q4k" if q4k_kernel_available() else "int8", FLOAT_DTYPE)
    hint = (
        f"marspec: {os.fspath(target)} runs in float32, as stored; target_quant='int8' (--target-quant int8) "
        "runs it on the faster int8 CPU engine, in a quarter of the memory (a slightly different model)"
    )
    return Precision("none", FLOAT_DTYPE, hint)
