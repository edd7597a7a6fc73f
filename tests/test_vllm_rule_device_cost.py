"""benchmarks/vllm_rule_device_cost.py on the CPU: the GPU run's script works, and its batch makes the
plugin relax exactly the close-call rows it planted (a quarter of the rows, never a bonus row)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "vllm_rule_device_cost.py"


def test_cpu_run_relaxes_the_planted_close_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "cost.json"
    argv = ["vllm_rule_device_cost.py", "--device", "cpu", "--repeats", "1", "--requests", "1,4"]
    monkeypatch.setattr(sys, "argv", [*argv, "--json", str(out)])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    results = json.loads(out.read_text())["results"]
    # Rows 1, 5, 9, ... are close calls drafted at the runner-up; every fifth row is a bonus row (not
    # a draft), so 1 request (rows 0-4) relaxes row 1 and 4 requests (rows 0-19) rows 1, 5, 13, 17.
    assert [(r["rows"], r["relaxed_rows"]) for r in results] == [(5, 1), (20, 4)]
    assert all(r["argmax_ms"] > 0 and r["plugin_ms"] > 0 for r in results)
