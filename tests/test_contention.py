"""How busy the rest of the machine was during a decode: the arithmetic of LoadWatch on the kernel's
counters, read here from scripted counters and a written /proc/stat, so that no result depends on what
else the machine runs. (The same checks against a real spinning process: benchmarks/load_watch.py.)"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from marspec.eval import contention
from marspec.eval.contention import CONTENDED_CORES, LoadWatch, contended


def scripted(
    monkeypatch: pytest.MonkeyPatch,
    machine_busy: tuple[float | None, float | None],
    own: tuple[float, float],
    wall: tuple[float, float],
) -> None:
    """LoadWatch reads these (start, end) pairs: all processes' busy CPU seconds, this process's, the
    clock."""

    def reader(pair: tuple) -> Callable[[], Any]:
        values = iter(pair)
        return lambda: next(values)

    monkeypatch.setattr(contention, "_machine_busy_s", reader(machine_busy))
    monkeypatch.setattr(contention, "_own_cpu_s", reader(own))
    monkeypatch.setattr(contention, "time", SimpleNamespace(perf_counter=reader(wall)))


def watched() -> float | None:
    with LoadWatch() as load:
        pass
    return load.other_cores


def test_another_busy_process_is_seen(monkeypatch):
    # Over 2 s the machine spent 2 more CPU seconds, none of them this process's: one other busy core.
    scripted(monkeypatch, machine_busy=(100.0, 102.0), own=(5.0, 5.0), wall=(10.0, 12.0))
    assert watched() == 1.0


def test_the_watching_process_own_work_is_not_counted(monkeypatch):
    scripted(monkeypatch, machine_busy=(100.0, 102.0), own=(5.0, 7.0), wall=(10.0, 12.0))
    assert watched() == 0.0
    scripted(monkeypatch, machine_busy=(100.0, 103.0), own=(5.0, 7.0), wall=(10.0, 12.0))
    assert watched() == 0.5  # only the other process's second


def test_counters_ticking_behind_own_time_give_zero_not_a_negative_load(monkeypatch):
    # The machine's counters tick 100 times a second, this process's time more finely.
    scripted(monkeypatch, machine_busy=(100.0, 100.99), own=(5.0, 6.0), wall=(10.0, 11.0))
    assert watched() == 0.0


def test_a_block_too_short_to_measure_gives_none(monkeypatch):
    scripted(monkeypatch, machine_busy=(100.0, 100.4), own=(5.0, 5.0), wall=(10.0, 10.4))
    assert watched() is None


@pytest.mark.parametrize("unreadable", [(None, 102.0), (100.0, None)], ids=["at-start", "at-end"])
def test_unreadable_counters_give_none(monkeypatch, unreadable):
    scripted(monkeypatch, machine_busy=unreadable, own=(5.0, 5.0), wall=(10.0, 12.0))
    assert watched() is None


def test_the_machine_busy_time_sums_the_busy_fields_of_proc_stat(monkeypatch, tmp_path: Path):
    # user nice system idle iowait irq softirq steal guest guest_nice: idle and iowait are not busy,
    # guest time is already inside user.
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 20 30 5000 70 4 6 2 50 0\ncpu0 50 10 15 2500 35 2 3 1 25 0\n")
    monkeypatch.setattr(contention, "_PROC_STAT", stat)
    busy_ticks = 100 + 20 + 30 + 4 + 6 + 2
    assert contention._machine_busy_s() == pytest.approx(busy_ticks / os.sysconf("SC_CLK_TCK"))
    stat.write_text("intr 1 2 3\n")
    assert contention._machine_busy_s() is None
    monkeypatch.setattr(contention, "_PROC_STAT", tmp_path / "missing")
    assert contention._machine_busy_s() is None


def test_contended_records():
    assert contended({"other_cores": CONTENDED_CORES + 0.01})
    assert not contended({"other_cores": 0.0})
    assert not contended({})  # records made before the measure existed
    assert not contended({"other_cores": None})  # not measurable there
