"""CUDA graphs: one forward shape captured once and replayed, so its ~1,000 kernel launches cost one.

A captured graph replays the very kernels that ran while it was captured, on the same memory: inputs
are written into static buffers before a replay and the output is read from a static buffer after it.
So a captured forward must take every per-step value as a device tensor (the fixed-shape backend,
:mod:`marspec.backends.fixed`, is built that way) and must not read the host.

Manual capture (``torch.cuda.CUDAGraph``) rather than ``torch.compile(mode="reduce-overhead")``: replay
runs eager's own kernels for the same shapes, so a replay's output equals the uncaptured fixed-shape
forward bit for bit (checked at each capture, below), while compiled, fused kernels round differently and
add a compiler, its recompiles and minutes of warm-up to every run. docs/architecture.md says more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

WARMUP_RUNS = 2  # eager runs on a side stream before capture: lazy kernel and workspace set-up happens here


@dataclass(frozen=True)
class CaptureRecord:
    """One capture: its shape key, whether replay reproduced the uncaptured forward, and the detail."""

    key: tuple
    passed: bool
    detail: str


class CapturedForward:
    """``fn(**inputs)`` captured as a CUDA graph. The inputs given here are used for the warm-up runs,
    the capture and :meth:`check`, so they must be a real call's inputs: the warm-up runs execute it."""

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor]) -> None:
        self.inputs = {name: value.clone() for name, value in inputs.items()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                self.reference = fn(**self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = fn(**self.inputs)

    def check(self) -> bool:
        """Replay with the capture's inputs and compare with the last uncaptured run: whether they are
        identical bit for bit (one host read, once per capture)."""
        self.graph.replay()
        same = torch.equal(self.output, self.reference)
        del self.reference
        return bool(same)

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Write ``inputs`` into the static buffers and replay; the result is the static output buffer,
        overwritten by the next replay (copy what must outlive it)."""
        for name, value in inputs.items():
            self.inputs[name].copy_(value)
        self.graph.replay()
        return self.output


class GraphCache:
    """Captured forwards by shape key, captured on first use and checked once each.

    A shape whose replay did not reproduce the uncaptured forward is recorded as failed and runs
    uncaptured from then on: a captured path is used only where it passed its check on this device."""

    def __init__(self) -> None:
        self._graphs: dict[tuple, CapturedForward | None] = {}
        self.records: list[CaptureRecord] = []

    def run(
        self, key: tuple, fn: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``fn(**inputs)``, replayed from the graph captured for ``key`` (capturing it on first use)."""
        if key not in self._graphs:
            captured = CapturedForward(fn, inputs)
            passed = captured.check()
            self._graphs[key] = captured if passed else None
            detail = "replay == eager, bit for bit" if passed else "replay != eager: runs uncaptured"
            self.records.append(CaptureRecord(key, passed, detail))
        graph = self._graphs[key]
        return fn(**inputs) if graph is None else graph(inputs)

    def clear(self) -> None:
        """Drop every graph (their buffers changed: the cache grew). Records are kept."""
        self._graphs.clear()

    def __len__(self) -> int:
        return sum(graph is not None for graph in self._graphs.values())
