"""The committed benchmark runs re-summarise byte for byte: a change to the evaluation code that alters
any published summary (a metric, a rounding, the markdown) fails here, on the run it changed.

Each run under docs/results/ that kept its records is copied into a temporary directory and summarised
again there, as ``marspec report --resummarize`` does; docs/results/ itself is only read. Runs summarised
by an older marspec lack the fields added since (``speedup_vs_strict``, ``cpus``, ...): their
``summary.json`` is compared byte for byte with the new summary cut down to the fields they hold, so a
field may be added but no published value may change.

Byte for byte holds in the environment the summaries were written in (Python 3.11 with the locked numpy,
constraints/py3.11.txt). Another numpy or Python may add in another order and round a float's last
digits differently, which is not a change to the evaluation code: there (the compatibility pass) the
markdown must still be identical and every float in the JSON equal to 1e-9, everything else exact.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy
import pytest

from marspec.eval.rundir import CONFIG_FILE, PROFILE_FILE, RECORDS_FILE, SUMMARY_JSON, SUMMARY_MD
from marspec.eval.summary import resummarize

RESULTS = Path(__file__).parents[1] / "docs" / "results"
RUNS = sorted(path.parent for path in RESULTS.glob(f"*/{RECORDS_FILE}"))
_LOCK = (Path(__file__).parents[1] / "constraints" / "py3.11.txt").read_text()
LOCKED_NUMPY = re.search(r"^numpy==(\S+)", _LOCK, re.MULTILINE).group(1)
BYTE_EXACT = sys.version_info[:2] == (3, 11) and numpy.__version__ == LOCKED_NUMPY


def _cut_to(new: Any, old: Any) -> Any:
    """``new`` with only the dictionary keys ``old`` has, at every level, in ``new``'s order."""
    if isinstance(new, dict) and isinstance(old, dict):
        return {key: _cut_to(value, old[key]) for key, value in new.items() if key in old}
    return new


def _same_to_rounding(new: Any, old: Any) -> bool:
    """Equal, floats to a relative 1e-9 (another numpy's summation order), everything else exactly."""
    if isinstance(new, float) and isinstance(old, float):
        return math.isclose(new, old, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(new, dict) and isinstance(old, dict):
        return list(new) == list(old) and all(_same_to_rounding(new[k], old[k]) for k in new)
    if isinstance(new, list) and isinstance(old, list):
        return len(new) == len(old) and all(_same_to_rounding(a, b) for a, b in zip(new, old, strict=True))
    return type(new) is type(old) and new == old


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
    if BYTE_EXACT:
        assert json.dumps(cut, indent=2) + "\n" == committed
    else:
        assert _same_to_rounding(cut, json.loads(committed))
