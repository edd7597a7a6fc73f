"""The one command a lent GPU machine runs: marspec's self-test on the device (its "fixed shapes ==
eager" row captures CUDA graphs there and reports each capture), then benchmarks/device_loop_cost.py at
the default pair's sizes (random weights, bf16; eager against replayed forwards, decodes on both paths,
the speed-up the CPU-measured tau predicts), then benchmarks/fixed_batch.py (the fixed-shape path with
a batch dimension at 1, 4, 16 and 64 sequences, same sizes). Each part runs in a process of its own
under a time limit and writes its JSON as it goes, so a limit or a crash loses little; a summary
(gpu-check.json) follows each part. Needs marspec (run from the source tree), torch and transformers
only: no weights, no tokenizer files (the loop-cost models are random; without ``--tokenizer`` the
prompt is encoded with the self-test's byte-level tokenizer, the models keeping the Qwen vocabulary's
151,936 rows).

    PYTHONPATH=src python3 benchmarks/gpu_check.py --out "$OUT"    # an H200: 3.5-4.5 minutes + the batch part

``--device cpu --small`` runs the same three parts at tiny sizes (about a minute), so the command is
checked end to end where there is no GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from _common import script_parser, write_json  # this folder's shared helpers

LOOP_COST = Path(__file__).with_name("device_loop_cost.py")
FIXED_BATCH = Path(__file__).with_name("fixed_batch.py")
SELFTEST = """
import json, sys
from marspec.selftest import run_selftest
report = run_selftest(sys.argv[1])
open(sys.argv[2], "w").write(json.dumps(report.to_dict(), indent=2) + "\\n")
for check in report.checks:
    print(("PASS" if check.passed else "FAIL"), check.name, "|", check.detail)
sys.exit(0 if report.passed else 1)
"""


def run_part(name: str, command: list[str], limit_s: float, summary: dict, out: Path) -> None:
    """Run one part in a process of its own, at most ``limit_s`` seconds; note how it ended."""
    begun = time.perf_counter()
    print(f"== {name}: {' '.join(command)} (limit {limit_s:.0f} s)", flush=True)
    try:
        result = subprocess.run(command, timeout=limit_s, check=False)
        ended = {"rc": result.returncode}
    except subprocess.TimeoutExpired:
        ended = {"rc": None, "timed_out": True}
    summary["parts"][name] = {**ended, "seconds": round(time.perf_counter() - begun, 1)}
    write_json(out / "gpu-check.json", summary)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, cpu or mps")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check")))
    parser.add_argument("--small", action="store_true", help="tiny loop-cost models (a CPU check)")
    parser.add_argument("--tokenizer", help="a Qwen2.5 tokenizer folder for the loop-cost prompt")
    parser.add_argument("--selftest-limit", type=float, default=120, help="seconds (default 120)")
    parser.add_argument("--loop-cost-limit", type=float, default=360, help="seconds (default 360)")
    parser.add_argument("--fixed-batch-limit", type=float, default=150, help="seconds (default 150)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {
        "device": args.device,
        "small": args.small,
        "started": time.strftime("%F %T"),
        "parts": {},
    }
    tag = args.device.replace(":", "")
    selftest = [sys.executable, "-c", SELFTEST, args.device, str(args.out / f"selftest-{tag}.json")]
    run_part("selftest", selftest, args.selftest_limit, summary, args.out)
    dtype = "fp32" if args.device == "cpu" else "bf16"
    loop_cost = [sys.executable, str(LOOP_COST), "--device", args.device, "--dtype", dtype]
    loop_cost += ["--json", str(args.out / f"device-loop-cost-{tag}.json")]
    if args.small:
        loop_cost += ["--small", "--new-tokens", "16", "--repeats", "1", "--cost-repeats", "2"]
    if args.tokenizer:
        loop_cost += ["--tokenizer", args.tokenizer]
    run_part("device_loop_cost", loop_cost, args.loop_cost_limit, summary, args.out)
    fixed_batch = [sys.executable, str(FIXED_BATCH), "--device", args.device, "--dtype", dtype]
    fixed_batch += ["--json", str(args.out / f"fixed-batch-{tag}.json")]
    if args.small:
        fixed_batch += ["--small", "--new-tokens", "16", "--repeats", "2"]
    run_part("fixed_batch", fixed_batch, args.fixed_batch_limit, summary, args.out)
    return 0 if all(part.get("rc") == 0 for part in summary["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
