"""benchmarks/vllm_rule_device_cost.py on the CPU: the GPU run's script works, and its batch makes the
plugin relax exactly the close-call rows it planted (a quarter of the rows, never a bonus row)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "vllm_rule_device_cost.py"


# Rows 1, 5, 9, ... are close calls drafted at the runner-up; every fifth row is a bonus row (not a
# draft), so 1 request (rows 0-4) has close call 1 and 4 requests (rows 0-19) close calls 1, 5, 13, 17.
# MARS relaxes all of them. FLy (window 2) defers only those whose request has two matched drafts after
# them: rows 1 and 5 (position 0), not 13 or 17 (positions 3 and 2, next to the bonus row).
@pytest.mark.parametrize(
    ("rule", "named", "relaxed"),
    [("mars", "mars logit_ratio 0.9", [1, 4]), ("fly", "fly 0.3 window 2", [1, 2])],
)
def test_cpu_run_relaxes_the_planted_close_calls(
    tmp_path: Path, rule: str, named: str, relaxed: list[int]
) -> None:
    out = tmp_path / "cost.json"
    argv = [sys.executable, str(SCRIPT), "--device", "cpu", "--repeats", "1", "--requests", "1,4"]
    subprocess.run([*argv, "--rule", rule, "--json", str(out)], check=True)  # as a lent GPU runs it
    report = json.loads(out.read_text())
    results = report["results"]
    assert report["rule"] == named
    assert [(r["rows"], r["relaxed_rows"]) for r in results] == list(zip([5, 20], relaxed, strict=True))
    assert all(r["argmax_ms"] > 0 and r["plugin_ms"] > 0 for r in results)
