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
    assert json.loads(out.read_text())["cases"].keys() == report["cases"].keys()
    assert set(report["target_forward_ms"]) == {1, 2, 4, 8, 13}
    cases = report["cases"]
    assert set(cases) == {
        "plain",
        "strict/copy",
        "mars/copy",
        "strict/small",
        "mars/small",
        "strict/copy/conf0",
        "strict/small/conf0",
    }
    # The copy drafts the target's own tokens: with the confidence stop off it drafts k and all pass.
    copy = cases["strict/copy/conf0"]
    assert copy["drafted"] == copy["accepted"] > 0
    assert copy["steps"] < cases["plain"]["steps"]
    assert cases["plain"]["drafted"] == 0 and cases["plain"]["steps"] == 12
    for name, case in cases.items():
        assert case.get("same_tokens_as_plain", True), name
        assert case["new_tokens"] == (12 if "copy" in name or name == "plain" else 6)
