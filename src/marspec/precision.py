"""Which weights a target runs with when the caller names no precision: the one decision behind
``target_quant="auto"`` and ``dtype="auto"`` for the library, the CLI, the server and the bench.

On a CPU, a model that comes as a GGUF (a known model's packaged file, or a ``.gguf`` path) runs on the
CPU engine built straight from the GGUF without a float32 copy (:mod:`marspec.models.int8_store`),
int8 activations one scale per token row, so that a verification forward costs little more than a
one-token step, which is where speculative decoding pays. Where marspec's CPU kernels run (x86 with AVX2 or
better, ARM with NEON dot products, and a C++ compiler: :mod:`marspec.backends.kernels`) the engine is
``"q4k"``: the GGUF's own Q4_K weights (the model as published, read at 4.75 bits a weight), its other layers
int8; elsewhere ``"int8"`` where oneDNN's int8 rows run (every layer int8 rows: 1.5x the bytes a step reads, a
different rounding of the same model), else float32. Either way strict verification equals plain decoding *of
it*; and whenever the engine is not the q4k engine, one line on stderr says which runs, why, and what it costs
(:func:`fallback_line`). A checkpoint in float safetensors (a folder or Hub id) keeps its own precision, with
a hint that names the int8 engine. Naming a dtype names a precision: the target then stays a float model.
Elsewhere (a GPU, a CPU without an int8 dot product, a model passed in loaded) nothing changes: float32
weights as loaded.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

import torch

from marspec.backends.int8 import rowwise_int8_available
from marspec.backends.kernels import kernels_available, unavailable_reason
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
    if kernels_available():
        return "q4k"
    _say(fallback_line("int8" if rowwise_int8_available() else "none"))
    return "int4"


def choose_precision(
    target: object, target_quant: str, dtype: str | torch.dtype, device: torch.device
) -> Precision:
    """``target_quant`` and ``dtype`` with ``"auto"`` replaced by this module's choice (see its
    docstring); values the caller named are returned as they are, for the loader to check."""
    if target_quant != AUTO:
        return Precision(target_quant, FLOAT_DTYPE if dtype == AUTO else dtype)
    if dtype != AUTO or device.type != "cpu" or not isinstance(target, (str, os.PathLike)):
        return Precision("none", FLOAT_DTYPE if dtype == AUTO else dtype)
    if comes_as_gguf(target):
        if kernels_available():
            return Precision("q4k", FLOAT_DTYPE)
        engine = "int8" if rowwise_int8_available() else "none"
        _say(fallback_line(engine))
        return Precision(engine, FLOAT_DTYPE)
    if not rowwise_int8_available():
        return Precision("none", FLOAT_DTYPE)
    hint = (
        f"marspec: {os.fspath(target)} runs in float32, as stored; target_quant='int8' (--target-quant int8) "
        "runs it on the faster int8 CPU engine, in a quarter of the memory (a slightly different model)"
    )
    return Precision("none", FLOAT_DTYPE, hint)


# What each engine a CPU may fall back to costs, against the q4k engine (docs/results.md: the default
# pair, demo prompts, on one CPU): in a user's words.
_FALLBACK_COST = {
    "int8": "~1.5x the q4k engine's time a token and ~1.2x its memory (2.5 GB for the default pair)",
    "none": "~4x the q4k engine's memory (~8 GB for the default pair) and several times its time a token",
}


def fallback_line(engine: str) -> str:
    """The line a user reads when the default CPU engine is ``engine`` ("int8" or "none", float32) instead
    of the q4k engine: which engine runs, why, and what it costs."""
    name = "the int8 engine" if engine == "int8" else "float32 weights"
    return (
        f"marspec: the q4k engine does not run here ({unavailable_reason()}); running {name} instead: "
        f"{_FALLBACK_COST[engine]}"
    )


@functools.cache
def _say(line: str) -> None:
    """Print ``line`` on stderr, once per process (the choice is made again for each model and call)."""
    print(line, file=sys.stderr, flush=True)
