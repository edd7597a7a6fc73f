"""Waking a batch's sequences one at a time after a forward, or all at once (``Batcher.wakes_in_turn``),
A/B in one process, the arms alternating:

1. **host cost**: tiny random models on the fixed-shape path (``graphs="on"``, uncaptured here: its
   batched forward of 64 one-token rows costs ~2.5 ms), plain decoding of 1, 4, 16 and 64 prompts
   together, 64 tokens each: wall milliseconds per sequence and step, which at many sequences is the
   host's work (each sequence's decode loop, the thread hand-overs) more than the forward's;
2. **the default engine**: the default pair on the q4k engine through the batch scheduler
   (``benchmarks/_common.scheduler_ab``: ``--clients`` clients, strict, the demo's prompts), tok/s.

Every arm's answers are compared: waking in turn changes no token.

    python benchmarks/batch_wakes.py --json docs/results/batch-wakes-2026-12-03.json   # ~6 minutes
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import add_scheduler_ab_args, machine, scheduler_ab, script_parser, write_json

from marspec.api import Decoder
from marspec.batch.batcher import Batcher
from marspec.selftest.tiny import tiny_decoder

ARMS = {"all at once": False, "in turn": True}


def host_cost(batches: list[int], rounds: int, new_tokens: int) -> list[dict]:
    """Per batch size, each arm's median wall ms per sequence and step (plain, tiny models)."""
    logging.getLogger("marspec.batch").setLevel(logging.ERROR)  # the fixed path's note, once per call
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pair = tiny_decoder(Path(tmp), torch.device("cpu"), graphs="on")
        decoder = Decoder(pair.target, None, device="cpu", graphs="on")
        prompts = [f"case {i}: " + "ab " * 5 for i in range(max(batches))]
        options = dict(rule="plain", max_new_tokens=new_tokens, chat=False)
        for b in batches:
            decoder.generate_many(prompts[:b], max_batch=b, **{**options, "max_new_tokens": 8})
            ms: dict[str, list[float]] = {arm: [] for arm in ARMS}
            answers: dict[str, list[list[int]]] = {}
            for round_ in range(rounds):
                for arm in list(ARMS) if round_ % 2 == 0 else list(ARMS)[::-1]:
                    Batcher.wakes_in_turn = ARMS[arm]
                    start = time.perf_counter()
                    results = decoder.generate_many(prompts[:b], max_batch=b, **options)
                    ms[arm].append(1000 * (time.perf_counter() - start) / new_tokens / b)
                    answers.setdefault(arm, [r.token_ids for r in results])
            row = {"sequences": b, **{arm: statistics.median(v) for arm, v in ms.items()}}
            row["same_answers"] = answers["in turn"] == answers["all at once"]
            rows.append(row)
            print(
                f"B={b:3d} ms per sequence and step: " + ", ".join(f"{a} {row[a]:.3f}" for a in ARMS),
                flush=True,
            )
    return rows


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--batches", default="1,4,16,64", help="sequences together, part 1")
    parser.add_argument("--clients", type=int, default=4, help="clients of part 2 (default 4)")
    add_scheduler_ab_args(parser, rounds=3, tokens=64)
    parser.add_argument("--json", type=Path, default=Path("batch_wakes.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    report: dict = {"machine": machine(), "arms": list(ARMS)}
    report["host_cost"] = host_cost([int(b) for b in args.batches.split(",")], args.rounds, 64)
    write_json(args.json, report)
    arms = {arm: (lambda turn=turn: setattr(Batcher, "wakes_in_turn", turn)) for arm, turn in ARMS.items()}
    report["default_engine"] = scheduler_ab(arms, args.clients, args.rounds, args.max_new_tokens)
    Batcher.wakes_in_turn = True
    write_json(args.json, report)
    print(report["default_engine"], flush=True)


if __name__ == "__main__":
    main()
