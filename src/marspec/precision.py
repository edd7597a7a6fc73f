"""Which weights a target runs with when the caller names no precision: the one decision behind
``target_quant="auto"`` and ``dtype="auto"`` for the library, the CLI, the server and the bench.

On a CPU, a model that comes as a GGUF (a known model's packaged file, or a ``.gguf`` path) runs on the
int8 engine (:mod:`marspec.models.int8_store`): built straight from the GGUF without a float32 copy,
its linear layers, LM head and embedding in int8, and a verification forward costing about one
one-token step, which is where speculative decoding pays. Its weights were 4-bit in the GGUF, so int8
stays close to the model as published; it is still a different model from the float32 one, and strict
verification equals plain decoding *of it*. A checkpoint in float safetensors (a folder or Hub id) keeps
its own precision, with a hint that names the int8 engine. Naming a dtype names a precision: the target
then stays a float model. Elsewhere (a GPU, a CPU without an int8 dot product, a model passed in loaded)
nothing changes: float32 weights as loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from marspec.backends.int8 import rowwise_int8_available
from marspec.models.registry import MODELS

AUTO = "auto"
# What "auto" means for a float target: float32, exact, on every device.
FLOAT_DTYPE = "fp32"


@dataclass(frozen=True)
class Precision:
    """A target's precision, chosen: ``target_quant`` ("none", "int8" or "int4"), the ``dtype`` of what
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
        return Precision("int8", FLOAT_DTYPE)
    hint = (
        f"marspec: {os.fspath(target)} runs in float32, as stored; target_quant='int8' (--target-quant int8) "
        "runs it on the faster int8 CPU engine, in a quarter of the memory (a slightly different model)"
    )
    return Precision("none", FLOAT_DTYPE, hint)
