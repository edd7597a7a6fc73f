"""The decode loop's own time per step on the CPU, apart from its model forwards, for before/after
comparisons of changes to the loop's hot path (decode.py, verify.py, token trees, the drafter).

Decodes with the self-test's tiny random pair (marspec.selftest.tiny: 2 layers, 96 tokens), whose
forwards cost about a millisecond, so the loop's own work (verification, tree layout, bookkeeping, the
drafter's Python) is a large share of each step. On the CPU the backends' clocks are exact (a CPU
forward returns when its work is done), so a step's overhead is its wall time minus the clocked
forwards. On a busy machine wall times also hold the waits for a core, so the CPU time this thread
spends per step (forwards included: one torch thread, so they run on it) is reported too: it depends
far less on the machine's other work, and two versions of the loop run the same forwards. Cases run
interleaved, ``--repeats`` times; each figure is the median over repeats of one decode's mean per step.
To compare two versions, run this once per source tree (PYTHONPATH), alternating a few times.

    PYTHONPATH=src python benchmarks/loop_overhead.py --repeats 15 --json after.json
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import script_parser, write_json  # this folder's shared helpers

from marspec.selftest.tiny import tiny_decoder

PROMPT = "def add(a, b): return a + b  # the sum of two numbers"
CASES = {
    "plain": {"rule": "plain"},
    "strict": {"rule": "strict"},
    "mars": {"rule": "mars", "theta": 0.3, "margin": "prob_ratio"},
    "strict-tree": {"rule": "strict", "tree": "3,2"},
    "mars-tree": {"rule": "mars", "theta": 0.3, "margin": "prob_ratio", "tree": "3,2"},
}


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one thread: less noise from a busy machine's other cores
    with tempfile.TemporaryDirectory() as tmp:
        decoder = tiny_decoder(Path(tmp), torch.device("cpu"))
    options = {"k": args.k, "max_new_tokens": args.new_tokens, "chat": False, "reuse_prefix": False}
    samples = {name: {"step": [], "overhead": [], "cpu": []} for name in CASES}
    for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
        for name, case in CASES.items():
            cpu_start = time.thread_time()
            stats = decoder.generate(PROMPT, **options, **case).stats
            cpu_s = time.thread_time() - cpu_start
            steps = stats.target_forwards
            loop_s = stats.wall_s - stats.prefill_s  # the prefill is the same for every version
            forwards_s = stats.target_forward_s - stats.prefill_s + stats.draft_forward_s
            if repeat:
                samples[name]["step"].append(1e6 * loop_s / steps)
                samples[name]["overhead"].append(1e6 * (loop_s - forwards_s) / steps)
                samples[name]["cpu"].append(1e6 * cpu_s / steps)  # the prefill included, alike in both
    report = {
        "us_per_step": {name: statistics.median(s["step"]) for name, s in samples.items()},
        "overhead_us_per_step": {name: statistics.median(s["overhead"]) for name, s in samples.items()},
        "cpu_us_per_step": {name: statistics.median(s["cpu"]) for name, s in samples.items()},
        "repeats": args.repeats,
        "new_tokens": args.new_tokens,
        "k": args.k,
        "load_average": os.getloadavg(),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
