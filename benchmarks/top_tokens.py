r"""The vocabulary kernels (marspec_vocab::top2 and ::argmax, marspec.verify.top_tokens) against torch's
operators, interleaved in one process: first the operators alone on 151,936-token rows (the default
pair's vocabulary) at 1, 3, 9 and 13 rows on 1 and 2 threads; then, with ``--clients N``, N clients
decoding the demo's 4 prompts in turn through the batch scheduler (no HTTP), kernel on and off in
alternating rounds: aggregate tok/s, the dispatcher's forward time, the rest (the sequences' own work
between forwards), and whether every prompt got one answer across all runs.

    python benchmarks/top_tokens.py --clients 4 --rounds 4 --out top-tokens.json

A timing: run it alone on the machine.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import add_scheduler_ab_args, git_commit, machine, scheduler_ab, script_parser, write_json

from marspec.backends import kernels
from marspec.backends.kernels import kernels_available
from marspec.verify import top_tokens
from marspec.verify.top_tokens import torch_top2

VOCAB = 151936


def operators() -> list[dict[str, Any]]:
    """Median microseconds a call, each operator pair interleaved."""
    rows_out = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for rows in (1, 3, 9, 13):
            logits = torch.randn(rows, VOCAB)
            calls = {
                "top2 torch": lambda x=logits: torch_top2(x),
                "top2 kernel": lambda x=logits: kernels.ops().vocab_top2(x),
                "argmax torch": lambda x=logits: x.argmax(-1),
                "argmax kernel": lambda x=logits: kernels.ops().vocab_argmax(x),
            }
            micros: dict[str, list[float]] = defaultdict(list)
            for _ in range(15):
                for name, call in calls.items():
                    start = time.perf_counter()
                    for _ in range(20):
                        call()
                    micros[name].append((time.perf_counter() - start) / 20 * 1e6)
            row = {"threads": threads, "rows": rows, **{k: statistics.median(v) for k, v in micros.items()}}
            print(", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
            rows_out.append(row)
    return rows_out


def batch(clients: int, rounds: int, max_new_tokens: int) -> dict[str, Any]:
    """``clients`` sequences through the scheduler, the kernel on and off in alternating rounds."""
    loaded = top_tokens._library_loaded

    def arm(kernel: bool) -> Callable[[], None]:
        def use() -> None:
            top_tokens._library_loaded = loaded if kernel else lambda: False  # type: ignore[assignment]

        return use

    try:
        return scheduler_ab({"torch": arm(False), "kernel": arm(True)}, clients, rounds, max_new_tokens)
    finally:
        top_tokens._library_loaded = loaded  # type: ignore[assignment]


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--clients", type=int, default=0, help="also the batch A/B with this many clients")
    add_scheduler_ab_args(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not kernels_available():
        raise SystemExit("the kernels' library does not build or run here")
    result: dict[str, Any] = {"commit": git_commit(), "machine": machine(), "operators_us": operators()}
    if args.clients:
        result["batch"] = batch(args.clients, args.rounds, args.max_new_tokens)
        print({arm: {k: round(v, 2) for k, v in m.items()} for arm, m in result["batch"]["medians"].items()})
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
