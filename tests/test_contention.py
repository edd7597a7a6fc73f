"""How busy the rest of the machine was during a decode: measured from the kernel's counters."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from marspec.eval.contention import CONTENDED_CORES, LoadWatch, contended

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc/stat")

SPIN = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass"


def test_another_busy_process_is_seen():
    spinner = subprocess.Popen([sys.executable, "-c", SPIN.format(s=2.0)])
    try:
        time.sleep(0.3)  # past the interpreter's start
        with LoadWatch() as load:
            time.sleep(1.0)
    finally:
        spinner.wait()
    assert load.other_cores is not None and load.other_cores > 0.5  # one spinning core, about 1.0


def _idle_then_spinning() -> tuple[float | None, float | None]:
    with LoadWatch() as idle:
        time.sleep(1.0)
    with LoadWatch() as load:
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:
            pass
    return idle.other_cores, load.other_cores


def test_the_watching_process_own_work_is_not_counted():
    # This process keeps a core busy; only what the rest of the machine did (measured just before, in
    # case something else runs) may be reported. Counting its own work would add about 1.0 on every
    # try; other work starting between the two windows adds to one try, hence up to three tries.
    tries = []
    for _ in range(3):
        idle, load = _idle_then_spinning()
        assert idle is not None and load is not None
        tries.append((idle, load))
        if load < idle + 0.5:
            return
    raise AssertionError(f"own work counted: (idle, spinning) other cores per try {tries}")


def test_a_block_too_short_to_measure_gives_none():
    with LoadWatch() as load:
        pass
    assert load.other_cores is None


def test_contended_records():
    assert contended({"other_cores": CONTENDED_CORES + 0.01})
    assert not contended({"other_cores": 0.0})
    assert not contended({})  # records made before the measure existed
    assert not contended({"other_cores": None})  # not measurable there
