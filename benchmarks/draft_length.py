"""Draft length k and the confidence stop on the default CPU engine: strict (or MARS) on the demo's
prompts for each setting, interleaved round by round in one process, against plain decoding; with each
setting's tokens a verification and its draft's time a forward (the draft step a kernel change moves:
run it at the two commits in alternating processes to compare them).

    python benchmarks/draft_length.py --k 12 8 6 --confidence 0.4 0.6 0.8 --out draft-length.json
"""

from __future__ import annotations

import itertools
import statistics

from _common import add_threads, decode_rates, machine, script_parser, write_json  # shared helpers

import marspec
from marspec.demo import DEMO_PROMPTS


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--k", type=int, nargs="+", default=[12, 8, 6])
    parser.add_argument("--confidence", type=float, nargs="+", default=[0.4, 0.6, 0.8])
    parser.add_argument("--rule", default="strict", choices=("strict", "mars"))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out")
    add_threads(parser)
    args = parser.parse_args()
    decoder = marspec.Decoder(threads=args.threads)
    prompts = [prompt for _, prompt in DEMO_PROMPTS]

    def run(rule: str, k: int, confidence: float) -> dict[str, float]:
        decoder.drafter.min_confidence = confidence  # the load setting draft_confidence, set in place
        return decode_rates(
            [decoder.generate(p, max_new_tokens=args.max_new_tokens, rule=rule, k=k).stats for p in prompts]
        )

    settings = [
        ("plain", 1, 0.0),
        *((args.rule, k, c) for k, c in itertools.product(args.k, args.confidence)),
    ]
    decoder.generate(prompts[0], max_new_tokens=16)  # warm
    measured: dict[tuple[str, int, float], list[dict[str, float]]] = {s: [] for s in settings}
    for _ in range(args.rounds):
        for setting in settings:
            measured[setting].append(run(*setting))
    plain = statistics.mean(r["tokens_per_s"] for r in measured[settings[0]])
    rows = []
    for (rule, k, confidence), runs in measured.items():
        per_round = {key: [r[key] for r in runs] for key in runs[0]}
        mean, per_verification, draft_ms = (
            statistics.mean(per_round[key])
            for key in ("tokens_per_s", "tokens_per_verification", "draft_ms_per_forward")
        )
        rows.append({"rule": rule, "k": k, "confidence": confidence, **per_round, "x_plain": mean / plain})
        print(
            f"{rule:6} k {k:2} stop {confidence:.2f}: {mean:6.1f} tok/s ({mean / plain:.2f}x plain), "
            f"{per_verification:.2f} tokens a verification, draft {draft_ms:.2f} ms a forward"
        )
    if args.out:
        write_json(args.out, {"machine": machine(), "engine": decoder.target_weights, "rows": rows})


if __name__ == "__main__":
    main()
