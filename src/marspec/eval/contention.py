"""How busy the rest of the machine was while a benchmark decoded.

A decode on a CPU with several threads is very sensitive to other work: a thread that loses its core
holds the others at the next barrier, so a short test run beside a benchmark can slow one decode 3x
and make its speed ratio meaningless. Each bench record therefore carries the CPU time other processes
used during it, in cores (``other_cores``: 0.0 on an idle machine, 1.0 for one other busy process), read
from the kernel's counters. Records above :data:`CONTENDED_CORES` are flagged in the summary and can be
decoded again (``marspec bench --redo-contended``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Other processes' average load, in cores, above which a record's timing is suspect. Beside a running
# bench on this project's quiet 2-core machine the rest measured 0.01 cores over 10 s; a second process
# decoding or testing takes up to a whole core.
CONTENDED_CORES = 0.25
_PROC_STAT = Path("/proc/stat")


def _machine_busy_s() -> float | None:
    """CPU seconds all processes have spent busy since boot (Linux), or None where unknown."""
    try:
        fields = _PROC_STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is already counted in user)
    ticks = [int(v) for v in fields[1:9]]
    busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7]
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class LoadWatch:
    """Measures, over a ``with`` block, the cores other processes kept busy on average.

    ``other_cores`` is None where the machine's counters cannot be read (not Linux) or the block was too
    short to measure (the counters tick 100 times a second).
    """

    def __init__(self) -> None:
        self.other_cores: float | None = None
        self._start: tuple[float | None, float, float] = (None, 0.0, 0.0)

    def __enter__(self) -> LoadWatch:
        self._start = (_machine_busy_s(), _own_cpu_s(), time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        busy0, own0, wall0 = self._start
        busy1, own1, wall1 = _machine_busy_s(), _own_cpu_s(), time.perf_counter()
        wall = wall1 - wall0
        if busy0 is None or busy1 is None or wall < 0.5:
            return
        others = (busy1 - busy0) - (own1 - own0)
        self.other_cores = round(max(0.0, others) / wall, 3)


def contended(record: Mapping[str, Any]) -> bool:
    """True when a bench record was decoded while other processes used more than CONTENDED_CORES."""
    load = record.get("other_cores")
    return load is not None and load > CONTENDED_CORES
