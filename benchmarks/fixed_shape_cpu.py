"""The fixed-shape path (``graphs="on"``) against the eager path on the CPU, on the real default pair.

Both paths run on the same loaded weights (the fixed-shape Decoder wraps the eager one's models), in
one process, interleaved prompt by prompt with the order alternating (eager first, then fixed first), so
drift on a shared machine hits both alike. Per path: plain and strict tokens per second, and whether the
two paths decoded the same tokens; the load average before and after says how shared the machine was.
Besides tokens per second (wall clock), each run's CPU time per token: on a busy machine the wall clock
measures the other jobs too, while with ``--threads 1`` the process's CPU time is close to the work.
Ratios are fixed over eager in speed (above 1: the fixed-shape path is faster), per pair and median.

    python benchmarks/fixed_shape_cpu.py --threads 2 --json out.json

The JSON is written after each pair of runs, and no pair starts after ``--budget-s`` seconds, so a busy
machine shortens the run instead of losing it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
from _common import add_threads, script_parser, write_json  # this folder's shared helpers

from marspec.api import Decoder
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET

PROMPTS = (
    "Write a Python function `merge_sorted(a, b)` that merges two sorted lists, with a docstring.",
    "Write a Python class `LRUCache` with get and put methods, both O(1), and a short usage example.",
)


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    add_threads(parser)
    parser.add_argument("--rounds", type=int, default=1, help="passes over the prompts (default 1)")
    parser.add_argument("--plain-tokens", type=int, default=32)
    parser.add_argument("--strict-tokens", type=int, default=96)
    parser.add_argument("--json", type=Path, default=Path("fixed_shape_cpu.json"))
    parser.add_argument(
        "--budget-s", type=float, default=540, help="start no new pair after this many seconds (default 540)"
    )
    args = parser.parse_args(argv)
    begun = time.perf_counter()
    torch.set_num_threads(args.threads)
    eager = Decoder(DEFAULT_TARGET, DEFAULT_DRAFT, dtype="fp32", device="cpu", graphs="off")
    fixed = Decoder(eager.target, eager.drafter.draft_model, dtype="fp32", device="cpu", graphs="on")
    decoders = {"eager": eager, "fixed": fixed}
    lengths = {"plain": args.plain_tokens, "strict": args.strict_tokens}
    rates: dict[str, list[float]] = {f"{rule}/{path}": [] for rule in lengths for path in decoders}
    # CPU seconds per token (this process's, all threads): on a shared machine the wall clock measures the
    # other jobs as much as this one; with one thread the CPU time is close to the work itself.
    cpu: dict[str, list[float]] = {name: [] for name in rates}
    same = True
    load_before = os.getloadavg()
    for decoder in decoders.values():  # warm-up
        decoder.generate(PROMPTS[0], rule="strict", max_new_tokens=4)
    ratios: dict[str, list[float]] = {rule: [] for rule in lengths}
    cpu_ratios: dict[str, list[float]] = {rule: [] for rule in lengths}

    def report() -> dict:
        summary = {name: statistics.median(values) for name, values in rates.items() if values}
        done = [rule for rule in lengths if ratios[rule]]
        out = {
            "threads": args.threads,
            "cpu": torch.backends.cpu.get_cpu_capability(),
            "rounds": args.rounds,
            "prompts": len(PROMPTS),
            "pairs_done": {rule: len(ratios[rule]) for rule in lengths},
            "tok_per_s_median": summary,
            "tok_per_s": rates,
            "fixed_over_eager": {r: summary[f"{r}/fixed"] / summary[f"{r}/eager"] for r in done},
            "paired_fixed_over_eager": ratios,
            "paired_median": {r: statistics.median(ratios[r]) for r in done},
            "cpu_s_per_token": cpu,
            "paired_cpu_fixed_over_eager": cpu_ratios,
            "paired_cpu_median": {r: statistics.median(cpu_ratios[r]) for r in done},
            "same_tokens": same,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "seconds": time.perf_counter() - begun,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        write_json(args.json, out)  # after each pair: a cut run keeps its pairs
        return out

    for round_ in range(args.rounds):
        for i, prompt in enumerate(PROMPTS):
            # Each round runs one prompt eager first and the other fixed first (for both rules).
            order = list(decoders) if (round_ + i) % 2 == 0 else list(reversed(decoders))
            for rule, tokens in lengths.items():
                if time.perf_counter() - begun > args.budget_s:
                    break
                outs = {}
                for path in order:
                    cpu_start = time.process_time()
                    result = decoders[path].generate(
                        prompt, rule=rule, max_new_tokens=tokens, reuse_prefix=False
                    )
                    cpu[f"{rule}/{path}"].append((time.process_time() - cpu_start) / len(result.token_ids))
                    rates[f"{rule}/{path}"].append(result.stats.tokens_per_s)
                    outs[path] = result.token_ids
                same = same and outs["eager"] == outs["fixed"]
                ratios[rule].append(rates[f"{rule}/fixed"][-1] / rates[f"{rule}/eager"][-1])
                # Work per token: eager's over fixed's, so that above 1 means fixed is cheaper, as for rates.
                cpu_ratios[rule].append(cpu[f"{rule}/eager"][-1] / cpu[f"{rule}/fixed"][-1])
                report()
    final = report()
    print(json.dumps(final, indent=2))
    return final


if __name__ == "__main__":
    main()
