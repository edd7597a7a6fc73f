"""benchmarks/device_loop_cost.py end to end at small sizes on the CPU: the GPU run's script works, its
copy draft really is the target (every draft accepted), and strict decoding reproduces plain's tokens."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def _script():
    path = Path(__file__).parents[1] / "benchmarks" / "device_loop_cost.py"
    spec = importlib.util.spec_from_file_location("device_loop_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_small_run_end_to_end(tmp_path):
    out = tmp_path / "cost.json"
    args = ["--small", "--device", "cpu", "--dtype", "fp32", "--new-tokens", "12", "--k", "4"]
    report = _script().main([*args, "--repeats", "1", "--cost-repeats", "1", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["cases"].keys() == report["cases"].keys()
    assert written["parts_done"][-1] == "done"
    for mode in ("off", "on"):
        forward = report["forward_ms"][mode]
        assert set(forward["target"]) == {1, 2, 4, 8, 5} and set(forward["draft"]) == {1, 2}
        assert forward["draft_chunk_4"] > 0 and forward["captures"] == []  # no capture on a CPU
        assert report["prediction"][mode]["speedup_vs_plain"] > 0
    cases = report["cases"]
    kinds = ["plain", "strict/copy", "mars/copy", "strict/small", "mars/small"]
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
