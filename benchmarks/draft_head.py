r"""The draft's narrow-first output layer (``marspec.backends.draft_head``) against its whole layer, on
the default CPU engine: strict (and MARS) on the demo's prompts, the two ways interleaved round by round
in one process, each round's order turned.

Per way: tokens a second over the prompts, strict's tokens per verification (what a draft that scores
fewer ids may lose), and the draft's forward time per drafted token (what it wins). Strict's tokens are
the target's own either way (checked); a draft proposal only decides how many are accepted at once.

    python benchmarks/draft_head.py --rounds 4 --out docs/results/draft-head-2026-12-07.json
"""

from __future__ import annotations

import statistics
from typing import Any

from _common import add_threads, decode_rates, machine, script_parser, write_json  # shared helpers

import marspec
from marspec.backends.draft_head import NarrowFirstHead
from marspec.demo import DEMO_PROMPTS

WAYS = {"narrow first": True, "whole layer": False}


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--rules", nargs="+", default=["strict", "mars"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out")
    add_threads(parser)
    args = parser.parse_args()
    decoder = marspec.Decoder(threads=args.threads)
    head = decoder.drafter.draft_model.model.get_output_embeddings()
    if not isinstance(head, NarrowFirstHead):
        raise SystemExit(
            f"the draft's output layer is {type(head).__name__}, not narrow-first: nothing to compare"
        )
    prompts = [prompt for _, prompt in DEMO_PROMPTS]
    new = args.max_new_tokens
    decoder.generate(prompts[0], max_new_tokens=16)  # warm
    runs: dict[tuple[str, str], list[dict[str, float]]] = {(w, r): [] for w in WAYS for r in args.rules}
    tokens: dict[tuple[str, str], list[list[int]]] = {}
    for round_ in range(args.rounds):
        order = list(WAYS) if round_ % 2 == 0 else list(reversed(WAYS))
        for way in order:
            head.narrow_first = WAYS[way]
            for rule in args.rules:
                results = [decoder.generate(p, rule=rule, max_new_tokens=new) for p in prompts]
                runs[way, rule].append(decode_rates([r.stats for r in results]))
                tokens.setdefault((way, rule), [r.token_ids for r in results])
    head.narrow_first = True
    if "strict" in args.rules:
        same = tokens["narrow first", "strict"] == tokens["whole layer", "strict"]
        print(f"strict's tokens the same either way: {same}")
    summary: dict[str, Any] = {}
    for rule in args.rules:
        for way in WAYS:
            med = {k: statistics.median(run[k] for run in runs[way, rule]) for k in runs[way, rule][0]}
            summary[f"{rule}, {way}"] = med
            print(
                f"{rule:6s} {way:12s} {med['tokens_per_s']:6.2f} tok/s  {med['tokens_per_verification']:.2f} "
                f"tokens/verification  draft {med['draft_ms_per_forward']:.2f} ms a forward"
            )
        ratios = [
            n["tokens_per_s"] / w["tokens_per_s"]
            for n, w in zip(runs["narrow first", rule], runs["whole layer", rule], strict=True)
        ]
        summary[f"{rule}, narrow first / whole layer, per round"] = ratios
        print(f"{rule}: narrow first / whole layer, per round: " + ", ".join(f"{r:.3f}" for r in ratios))
    if args.out:
        write_json(args.out, {"machine": machine(), "rounds": args.rounds, "summary": summary})


if __name__ == "__main__":
    main()
