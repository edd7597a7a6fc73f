"""Timing a backend's forwards where they run, without making the device wait.

A CPU forward returns when its work is done, so its wall time is its cost. A GPU forward returns once
its kernels are queued: wall time around it measures the launches, and a synchronisation to measure
more would stall the loop (the host could no longer queue the next forward while the device works). So
on an accelerator each forward is bracketed by two timing events recorded on the device's stream, and
:class:`marspec.interfaces.ForwardClock` reads the time between them later, once the device has passed
them (the decode loop reads its clocks after the step's one host read).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from marspec.devices import synchronize
from marspec.interfaces import ForwardClock


class ForwardTimer:
    """Starts and stops the timing of one forward at a time on ``device``, counting it on ``clock``."""

    def __init__(self, device: torch.device, clock: ForwardClock) -> None:
        self.device = device
        self.clock = clock
        self.events = device.type != "cpu" and _has_timing_events(device)

    def start(self) -> float | torch.Event:
        if self.events:
            event = torch.Event(device=self.device, enable_timing=True)
            event.record()
            return event
        if self.device.type != "cpu":
            synchronize(self.device)  # a device without timing events: time it by waiting for it
        return time.perf_counter()

    def stop(self, start: float | torch.Event, also: Sequence[ForwardClock] = ()) -> None:
        """End the forward begun at ``start``; count it on the clock, and on the clocks ``also`` (other
        sequences a batched forward served, each of which waited for all of it)."""
        clocks = (self.clock, *also)
        if isinstance(start, float):
            if self.device.type != "cpu":
                synchronize(self.device)
            elapsed = time.perf_counter() - start
            for clock in clocks:
                clock.tick(elapsed)
            return
        end = torch.Event(device=self.device, enable_timing=True)
        end.record()
        for clock in clocks:
            clock.record(start, end)


def _has_timing_events(device: torch.device) -> bool:
    """Whether this torch build records timing events on ``device`` (CUDA does; a backend that does not
    raises on creating or recording one)."""
    try:
        torch.Event(device=device, enable_timing=True).record()
    except (RuntimeError, ValueError, TypeError):
        return False
    return True
