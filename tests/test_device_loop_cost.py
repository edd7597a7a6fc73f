"""benchmarks/device_loop_cost.py end to end at small sizes on the CPU: the GPU run's script works, its
copy draft really is the target (every draft accepted), and strict decoding reproduces plain's tokens,
with a draft model and with an EAGLE-3 head."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def _run(name: str, *args: str) -> int:
    """The script run as a lent GPU runs it: a process of its own, marspec imported as installed."""
    return subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args]).returncode


def test_small_run_end_to_end(tmp_path):
    out = tmp_path / "cost.json"
    args = ["--small", "--device", "cpu", "--dtype", "fp32", "--new-tokens", "12", "--k", "4"]
    assert _run("device_loop_cost", *args, "--repeats", "1", "--cost-repeats", "1", "--json", str(out)) == 0
    report = json.loads(out.read_text())
    assert report["parts_done"][-1] == "done"
    for mode in ("off", "on"):
        forward = report["forward_ms"][mode]
        assert set(forward["target"]) == {"1", "2", "4", "8", "5"} and set(forward["draft"]) == {"1", "2"}
        assert forward["draft_chunk_4"] > 0 and forward["captures"] == []  # no capture on a CPU
        assert report["prediction"][mode]["speedup_vs_plain"] > 0
        assert forward["head"]["step"] > 0 and forward["head"]["chunk_4"] > 0
        predicted = report["head_prediction"][mode]
        assert len(predicted) == 6 and [p["tau"] for p in predicted] == sorted(p["tau"] for p in predicted)
        assert all(p["speedup_vs_plain"] > 0 for p in predicted)
    cases = report["cases"]
    kinds = ["plain", "strict/copy", "mars/copy", "strict/small", "mars/small", "strict/head"]
    kinds += ["strict/copy/conf0", "strict/small/conf0"]
    assert set(cases) == {f"{kind}@{mode}" for kind in kinds for mode in ("off", "on")}
    assert set(report["graphs_speedup"]) == set(kinds)
    for mode in ("off", "on"):
        # The copy drafts the target's own tokens: with the confidence stop off it drafts k and all pass.
        copy = cases[f"strict/copy/conf0@{mode}"]
        assert copy["drafted"] == copy["accepted"] > 0
        assert copy["steps"] < cases[f"plain@{mode}"]["steps"]
        assert cases[f"plain@{mode}"]["drafted"] == 0 and cases[f"plain@{mode}"]["steps"] == 12
    for name, case in cases.items():
        assert case.get("same_tokens_as_plain", True), name
        assert case.get("same_tokens_as_eager", True), name
        assert case["new_tokens"] == (12 if "copy" in name or "plain" in name else 6)


def test_the_gpu_command_runs_each_part_under_its_limit_and_keeps_what_finished(tmp_path):
    """benchmarks/gpu_check.py, the one command a lent GPU runs, at tiny sizes on the CPU: a part cut by
    its limit is recorded as such and the next part still runs and writes its JSON (the self-test part
    runs whole in tests/test_selftest.py; here it is cut at once to keep this short)."""
    args = ["--device", "cpu", "--small", "--out", str(tmp_path), "--selftest-limit", "0.1"]
    assert _run("gpu_check", *args) == 1
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    assert summary["parts"]["selftest"]["timed_out"]
    assert summary["parts"]["device_loop_cost"]["rc"] == 0
    assert json.loads((tmp_path / "device-loop-cost-cpu.json").read_text())["parts_done"][-1] == "done"
