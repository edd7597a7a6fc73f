"""The committed benchmark runs re-summarise byte for byte: a change to the evaluation code that alters
any published summary (a metric, a rounding, the markdown) fails here, on the run it changed.

Each run under docs/results/ that kept its records is copied into a temporary directory and summarised
again there, as ``marspec report --resummarize`` does; docs/results/ itself is only read. Runs summarised
by an older marspec lack the fields added since (``speedup_vs_strict``, ``cpus``, ...): their
``summary.json`` is compared byte for byte with the new summary cut down to the fields they hold, so a
field may be added but no published value may change.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from marspec.eval.rundir import CONFIG_FILE, PROFILE_FILE, RECORDS_FILE, SUMMARY_JSON, SUMMARY_MD
from marspec.eval.summary import resummarize

RESULTS = Path(__file__).parents[1] / "docs" / "results"
RUNS = sorted(path.parent for path in RESULTS.glob(f"*/{RECORDS_FILE}"))


def _cut_to(new: Any, old: Any) -> Any:
    """``new`` with only the dictionary keys ``old`` has, at every level, in ``new``'s order."""
    if isinstance(new, dict) and isinstance(old, dict):
        return {key: _cut_to(value, old[key]) for key, value in new.items() if key in old}
    return new


def test_there_are_committed_runs_to_check() -> None:
    assert len(RUNS) >= 10, RUNS  # a moved results folder must not turn the check below into no check


@pytest.mark.parametrize("run", RUNS, ids=[run.name for run in RUNS])
def test_a_committed_run_resummarizes_byte_identical(run: Path, tmp_path: Path) -> None:
    for name in (CONFIG_FILE, RECORDS_FILE, PROFILE_FILE, SUMMARY_JSON):
        if (run / name).exists():
            shutil.copy2(run / name, tmp_path / name)
    resummarize(tmp_path)
    assert (tmp_path / SUMMARY_MD).read_bytes() == (run / SUMMARY_MD).read_bytes()
    committed = (run / SUMMARY_JSON).read_text()
    cut = _cut_to(json.loads((tmp_path / SUMMARY_JSON).read_text()), json.loads(committed))
    assert json.dumps(cut, indent=2) + "\n" == committed
