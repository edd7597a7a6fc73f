"""Counting host reads inside the forwards a GPU captures, on the CPU (shared by the fixed-shape tests)."""

from __future__ import annotations

import contextlib

import torch

from marspec.backends.fixed import FixedShapeLM
from marspec.backends.fixed_batch import FixedBatch
from marspec.drafters.eagle3_fixed import FixedHeadCache
from marspec.selftest import HostReads
from marspec.selftest.reads import _StandIn

# Moves to the host: on this CPU every tensor is on the host already, so a move is told from a no-op only
# for what is computed from the stand-in inputs (a tensor on the device on a GPU).
_MOVES = ("cpu", "to", "copy_")


@contextlib.contextmanager
def captured_regions_counted(*lms: FixedShapeLM | FixedBatch | FixedHeadCache):
    """Run every forward a GPU captures (a head's: every chain step) with stand-ins for device inputs,
    counting host reads (a CUDA graph cannot hold one): reads of any tensor's values (weights, caches
    and buffers included) and copies to the host of anything computed from the inputs."""
    counts: list[int] = []
    names = ["_chain" if isinstance(lm, FixedHeadCache) else "_forward_on_device" for lm in lms]
    originals = [getattr(lm, name) for lm, name in zip(lms, names, strict=True)]

    def counted(original):
        def run(**inputs):
            stand_ins = {name: value.as_subclass(_StandIn) for name, value in inputs.items()}
            with HostReads(lambda t: isinstance(t, _StandIn)) as moves, HostReads(lambda t: True) as values:
                out = original(**stand_ins)
            counts.append(len(moves.reads) + sum(name not in _MOVES for name in values.reads))
            return out.as_subclass(torch.Tensor)

        return run

    for lm, name, original in zip(lms, names, originals, strict=True):
        setattr(lm, name, counted(original))
    try:
        yield counts
    finally:
        for lm, name in zip(lms, names, strict=True):
            delattr(lm, name)
