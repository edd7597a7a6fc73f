"""A batch's host time per sequence and step: tiny random models on the fixed-shape path (``graphs="on"``,
uncaptured on the CPU: its batched forward of 64 one-token rows costs ~2.5 ms), plain decoding of 1, 4,
16 and 64 prompts together, 64 tokens each. Reported: wall milliseconds per sequence and step, and the
part of it outside the gathered forwards (each sequence's decode loop and the scheduler's own work),
which at many sequences is what the host adds to the forward.

    python benchmarks/batch_host_cost.py --json docs/results/batch-host-cost.json   # ~1 minute
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import forwards_timed, machine, script_parser, write_json

from marspec.api import Decoder
from marspec.selftest.tiny import tiny_decoder


def host_cost(batches: list[int], rounds: int, new_tokens: int) -> list[dict]:
    """Per batch size, the median wall ms per sequence and step, and the ms of it outside forwards."""
    logging.getLogger("marspec.batch").setLevel(logging.ERROR)  # the fixed path's note, once per call
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pair = tiny_decoder(Path(tmp), torch.device("cpu"), graphs="on")
        decoder = Decoder(pair.target, None, device="cpu", graphs="on")
        prompts = [f"case {i}: " + "ab " * 5 for i in range(max(batches))]
        options = dict(rule="plain", max_new_tokens=new_tokens, chat=False)
        with forwards_timed() as forwards:
            for b in batches:
                decoder.generate_many(prompts[:b], max_batch=b, **{**options, "max_new_tokens": 8})
                wall, host = [], []
                for _ in range(rounds):
                    forwards[0] = 0.0
                    start = time.perf_counter()
                    decoder.generate_many(prompts[:b], max_batch=b, **options)
                    elapsed = time.perf_counter() - start
                    wall.append(1000 * elapsed / new_tokens / b)
                    host.append(1000 * (elapsed - forwards[0]) / new_tokens / b)
                row = {"sequences": b, "ms": statistics.median(wall), "host_ms": statistics.median(host)}
                rows.append(row)
                print(
                    f"B={b:3d} ms a sequence and step {row['ms']:.3f}, outside forwards {row['host_ms']:.3f}"
                )
    return rows


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--batches", default="1,4,16,64", help="sequences together")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("batch_host_cost.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    report: dict = {"machine": machine()}
    report["host_cost"] = host_cost([int(b) for b in args.batches.split(",")], args.rounds, 64)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
