"""Prefix reuse on MT-Bench's second turn: time to first token with the first turn's cache kept, against a
fresh prefill of the whole conversation, side by side in one process (issue 18, item 5).

For each question and rule: turn 1 is decoded from scratch; turn 2 is then decoded twice on the same
messages, first keeping the cache turn 1 left (``reuse_prefix=True``, what a chat gets), then from an
empty cache (``reuse_prefix=False``). Both must give the same tokens (checked, reported); the times are
from the call to the first streamed text and to the end of the turn. The order is the same for every
pair, so a slow stretch of the machine lands on both halves of a pair alike.

    python benchmarks/prefix_reuse.py --questions 10 --out docs/results/prefix-reuse-mtbench.json
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _common import add_threads, machine, script_parser, write_json  # this folder's shared helpers

from marspec.api import Decoder, GenerationResult
from marspec.eval.datasets import load_task
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET

RULES = ("plain", "mars")


def timed_turn(
    decoder: Decoder, messages: list[dict[str, str]], **options: Any
) -> tuple[GenerationResult, float]:
    """Decode one turn; return it and the seconds from the call to its first text."""
    start = time.perf_counter()
    first: list[float] = []
    result = decoder.generate(
        messages, on_text=lambda _: first or first.append(time.perf_counter() - start), **options
    )
    return result, first[0] if first else result.stats.wall_s


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per turn (the speed table's 64)")
    add_threads(parser)
    parser.add_argument("--out", type=Path, help="write the per-turn measurements here as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    decoder = Decoder(DEFAULT_TARGET, DEFAULT_DRAFT, dtype="fp32", threads=args.threads)
    rows: list[dict[str, Any]] = []
    for question in load_task("mtbench", args.questions):
        for rule in RULES:
            opts = {"rule": rule, "max_new_tokens": args.max_new_tokens}
            messages = [{"role": "user", "content": question.turns[0]}]
            first, _ = timed_turn(decoder, messages, reuse_prefix=False, **opts)
            messages += [
                {"role": "assistant", "content": first.text},
                {"role": "user", "content": question.turns[1]},
            ]
            kept, kept_ttft = timed_turn(decoder, messages, reuse_prefix=True, **opts)
            fresh, fresh_ttft = timed_turn(decoder, messages, reuse_prefix=False, **opts)
            rows.append(
                {
                    "qid": question.qid,
                    "rule": rule,
                    "prompt_tokens": kept.stats.prompt_tokens,
                    "reused_tokens": kept.stats.reused_tokens,
                    "same_tokens": kept.token_ids == fresh.token_ids,
                    "ttft_reused_s": kept_ttft,
                    "ttft_fresh_s": fresh_ttft,
                    "prefill_reused_s": kept.stats.prefill_s,
                    "prefill_fresh_s": fresh.stats.prefill_s,
                    "turn_reused_s": kept.stats.wall_s,
                    "turn_fresh_s": fresh.stats.wall_s,
                }
            )
            r = rows[-1]
            print(
                f"{question.qid} {rule}: {r['reused_tokens']}/{r['prompt_tokens']} prompt tokens kept, "
                f"first token {r['ttft_fresh_s']:.2f}s -> {r['ttft_reused_s']:.2f}s, "
                f"same tokens: {r['same_tokens']}",
                flush=True,
            )

    print(
        "\n| rule | turn-2 prompt tokens (mean) | kept (mean) | time to first token: fresh | reused | "
        "ratio (median) | turn-2 wall: fresh | reused | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for rule in RULES:
        mine = [r for r in rows if r["rule"] == rule]

        keys = (
            "prompt_tokens",
            "reused_tokens",
            "ttft_fresh_s",
            "ttft_reused_s",
            "turn_fresh_s",
            "turn_reused_s",
        )
        m = {key: statistics.fmean(r[key] for r in mine) for key in keys}
        ratio = statistics.median(r["ttft_fresh_s"] / r["ttft_reused_s"] for r in mine)
        print(
            f"| {rule} | {m['prompt_tokens']:.0f} | {m['reused_tokens']:.0f} "
            f"| {m['ttft_fresh_s']:.2f} s | {m['ttft_reused_s']:.2f} s | {ratio:.2f}x "
            f"| {m['turn_fresh_s']:.2f} s | {m['turn_reused_s']:.2f} s "
            f"| {sum(r['same_tokens'] for r in mine)}/{len(mine)} |"
        )
    if args.out:
        meta = {
            **machine(),
            "target": DEFAULT_TARGET,
            "draft": DEFAULT_DRAFT,
            "threads": args.threads,
            "max_new_tokens": args.max_new_tokens,
        }
        write_json(args.out, {"settings": meta, "turns": rows})


if __name__ == "__main__":
    main()
