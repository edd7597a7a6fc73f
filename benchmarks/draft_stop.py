r"""The draft's length k and confidence stop on the default CPU engine, side by side in one process.

How long a draft should run depends on what a draft step costs against a verification: on the q4k engine
a draft step is ~0.45 of a target step, so a draft token that will be rejected costs much more than it
did beside an fp32 target. Each prompt is decoded with every setting back to back (the order rotated
from prompt to prompt), greedy. Strict verification gives the same tokens whatever the setting, so its
times compare like for like; MARS's outputs follow the drafts, so its times compare different texts.
The prompts are written here, not taken from an evaluation set (those are never used to choose defaults).

    python benchmarks/draft_stop.py --out docs/results/draft-stop-2026-12-02.json
    python benchmarks/draft_stop.py --settings "12:0.4 8:0.55" --rules strict

A timing: run it alone on the machine.
"""

from __future__ import annotations

import torch
from _common import add_threads, machine, script_parser, write_json

from marspec import Decoder
from marspec.defaults import DEFAULT_DRAFT_CONFIDENCE, DEFAULT_K

PROMPTS = (
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python class for a stack with push, pop and peek, raising IndexError when it is empty.",
    "Write a JavaScript function that debounces another function.",
    "Write a SQL query that returns the ten customers with the highest total order amount.",
    "Explain in a short paragraph what a hash table is and when to use one.",
    "List four differences between TCP and UDP.",
    "A train travels 120 km in 1.5 hours and then 80 km in 1 hour. What is its average speed? "
    "Think step by step.",
    "A shop sells pens at 3 for $2. How much do 18 pens cost? Explain briefly.",
)
SETTINGS = "12:0.4 12:0.55 12:0.7 8:0.4 8:0.55 8:0.7 6:0.55 10:0.55"


def main() -> None:
    parser = script_parser(__doc__)
    add_threads(parser)
    parser.add_argument("--settings", default=SETTINGS, help="k:confidence pairs, space-separated")
    parser.add_argument("--rules", default="strict,mars", help="comma-separated rules")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", help="where to write the JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = [(int(k), float(c)) for k, c in (pair.split(":") for pair in args.settings.split())]
    rules = args.rules.split(",")
    decoder = Decoder()
    totals = {
        (rule, s): {"seconds": 0.0, "tokens": 0, "target_forwards": 0} for rule in rules for s in settings
    }
    outputs: dict[tuple[str, tuple[int, float]], list[list[int]]] = {key: [] for key in totals}
    for number, prompt in enumerate(PROMPTS):
        order = settings[number % len(settings) :] + settings[: number % len(settings)]
        for rule in rules:
            for k, confidence in order:
                decoder.drafter.min_confidence = confidence
                result = decoder.generate(prompt, rule=rule, k=k, max_new_tokens=args.max_new_tokens)
                total = totals[rule, (k, confidence)]
                total["seconds"] += result.stats.wall_s
                total["tokens"] += result.stats.new_tokens
                total["target_forwards"] += result.stats.target_forwards
                outputs[rule, (k, confidence)].append(result.token_ids)
        print(f"prompt {number + 1}/{len(PROMPTS)} done", flush=True)
    rows = []
    for rule in rules:
        base = (
            totals[rule, (DEFAULT_K, DEFAULT_DRAFT_CONFIDENCE)]
            if (DEFAULT_K, DEFAULT_DRAFT_CONFIDENCE) in settings
            else None
        )
        for setting in settings:
            total = totals[rule, setting]
            rate = total["tokens"] / total["seconds"]
            row = {"rule": rule, "k": setting[0], "confidence": setting[1], "tok_s": rate, **total}
            if base is not None:
                row["vs_default"] = rate / (base["tokens"] / base["seconds"])
            row["same_output_as_first_setting"] = outputs[rule, setting] == outputs[rule, settings[0]]
            rows.append(row)
            print(
                f"{rule:6s} k {setting[0]:2d} confidence {setting[1]:.2f}: {rate:6.2f} tok/s"
                + (f" ({row['vs_default']:.3f}x the default)" if base is not None else "")
                + f", {total['target_forwards']} target forwards"
            )
    if args.out:
        write_json(args.out, {"meta": machine(), "args": vars(args), "prompts": PROMPTS, "rows": rows})


if __name__ == "__main__":
    main()
