"""The fixed-shape path (``graphs="on"``) against the eager path on the CPU, on the real default pair.

Both paths run on the same loaded weights (the fixed-shape Decoder wraps the eager one's models), in
one process, interleaved prompt by prompt, so drift on a shared machine hits both alike. Per path: plain
and strict tokens per second, and whether the two paths decoded the same tokens.

    python benchmarks/fixed_shape_cpu.py --threads 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from marspec.api import Decoder
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET

PROMPTS = (
    "Write a Python function `merge_sorted(a, b)` that merges two sorted lists, with a docstring.",
    "Write a Python class `LRUCache` with get and put methods, both O(1), and a short usage example.",
)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="passes over the prompts (default 1)")
    parser.add_argument("--plain-tokens", type=int, default=32)
    parser.add_argument("--strict-tokens", type=int, default=96)
    parser.add_argument("--json", type=Path, default=Path("fixed_shape_cpu.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    eager = Decoder(DEFAULT_TARGET, DEFAULT_DRAFT, dtype="fp32", device="cpu", graphs="off")
    fixed = Decoder(eager.target, eager.drafter.draft_model, dtype="fp32", device="cpu", graphs="on")
    decoders = {"eager": eager, "fixed": fixed}
    lengths = {"plain": args.plain_tokens, "strict": args.strict_tokens}
    rates: dict[str, list[float]] = {f"{rule}/{path}": [] for rule in lengths for path in decoders}
    same = True
    for prompt in PROMPTS:  # warm-up
        for decoder in decoders.values():
            decoder.generate(prompt, rule="strict", max_new_tokens=8)
    for _ in range(args.rounds):
        for prompt in PROMPTS:
            for rule, tokens in lengths.items():
                outs = {}
                for path, decoder in decoders.items():
                    result = decoder.generate(prompt, rule=rule, max_new_tokens=tokens, reuse_prefix=False)
                    rates[f"{rule}/{path}"].append(result.stats.tokens_per_s)
                    outs[path] = result.token_ids
                same = same and outs["eager"] == outs["fixed"]
    summary = {name: statistics.median(values) for name, values in rates.items()}
    report = {
        "threads": args.threads,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "rounds": args.rounds,
        "prompts": len(PROMPTS),
        "tok_per_s_median": summary,
        "tok_per_s": rates,
        "fixed_over_eager": {rule: summary[f"{rule}/fixed"] / summary[f"{rule}/eager"] for rule in lengths},
        "same_tokens": same,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
