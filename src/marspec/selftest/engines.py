"""The CPU's quantised engine keeps the invariants: on the int8 engine (the default on a CPU for a model
that comes as a GGUF), strict equals plain and rules that cannot relax equal strict, token for token."""

from __future__ import annotations

from pathlib import Path

import torch

from marspec.backends.int8 import rowwise_int8_available
from marspec.selftest.equality import no_relax_equals_strict, strict_equals_plain
from marspec.selftest.report import Check
from marspec.selftest.tiny import tiny_decoder

INT8_CHECK = "int8 engine: strict == plain, no-relax rules == strict"


def int8_engine_keeps_the_invariants(folder: Path, device: torch.device) -> Check | None:
    """Both equalities on the tiny pair with its target on the int8 engine (row-wise int8 linear layers,
    int8 embedding, attention row by row); None where that engine cannot run (another device, or a CPU
    without an int8 dot product)."""
    if device.type != "cpu" or not rowwise_int8_available():
        return None
    decoder = tiny_decoder(folder, device, target_quant="int8")
    checks = (strict_equals_plain(decoder), no_relax_equals_strict(decoder))
    failed = [c for c in checks if not c.passed]
    if failed:
        return Check(INT8_CHECK, False, f"{failed[0].name}: {failed[0].detail}")
    return Check(INT8_CHECK, True, "; ".join(c.detail for c in checks))
