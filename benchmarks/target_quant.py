r"""Target precisions side by side in one process: the fp32 target against an int8 one (issue 18, item 6)
and a bf16 one (fast on CPUs with AVX512-BF16), optionally with a bf16 draft instead of the int8 one.

The variants share one int8 draft unless named otherwise. For each question, plain and MARS (the default
setting) run on every variant back to back in the same order, so a slow stretch of the machine lands on
all alike. Reported per variant: ms per token of plain and MARS, MARS's speedup over its own plain, tau,
and its speed over the fp32 target's (medians of per-question ratios). How far a variant's greedy output
follows the fp32 one's is the first token where their plain decodes part; whether its answers are as
good is a graded run's question (``marspec bench --target-quant int8`` or ``--dtype bf16``). Peak memory
is per process: measure it with GNU time around ``marspec generate``.

    python benchmarks/target_quant.py --questions humaneval:4,gsm8k:4 --out docs/results/target-int8.json
    python benchmarks/target_quant.py --variants fp32,int8,bf16,bf16-draft \
        --out docs/results/target-precision.json

Variants: ``fp32`` (the default target, always run: the reference), ``int8`` (``target_quant="int8"``),
``bf16`` (``dtype="bf16"``, the shared int8 draft), ``bf16-draft`` (bf16 target and a bf16 draft, not
quantised; both oneDNN-prepacked).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import add_threads, machine, script_parser, write_json  # this folder's shared helpers

from marspec.api import Decoder
from marspec.backends.hf import HFCausalLM
from marspec.eval.compare import first_difference
from marspec.eval.datasets import load_task
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET

RULES = ("plain", "mars")

# Each variant's Decoder besides the fp32 reference, given the reference's (int8) draft model to share
# (bf16-draft loads its own).
VARIANTS: dict[str, Callable[[HFCausalLM], Decoder]] = {
    "int8": lambda draft: Decoder(DEFAULT_TARGET, draft, dtype="fp32", target_quant="int8"),
    "bf16": lambda draft: Decoder(DEFAULT_TARGET, draft, dtype="bf16"),
    "bf16-draft": lambda draft: Decoder(DEFAULT_TARGET, DEFAULT_DRAFT, dtype="bf16", draft_quant="none"),
}


def decode_all(decoders: dict[str, Decoder], questions: list, max_new_tokens: int) -> list[dict[str, Any]]:
    """Each question decoded by each variant under each rule, one row of measurements per decode."""
    rows: list[dict[str, Any]] = []
    for question in questions:
        messages = [{"role": "user", "content": question.turns[0]}]
        for target, decoder in decoders.items():
            for rule in RULES:
                result = decoder.generate(messages, rule=rule, max_new_tokens=max_new_tokens)
                stats = result.stats
                rows.append(
                    {
                        "qid": question.qid,
                        "target": target,
                        "rule": rule,
                        "token_ids": result.token_ids,
                        "new_tokens": stats.new_tokens,
                        "wall_s": stats.wall_s,
                        "ms_per_token": 1000 * stats.wall_s / stats.new_tokens,
                        "tau": stats.tau,  # the one definition: a final EOS counts as generated
                    }
                )
                print(f"{question.qid} {target} {rule}: {rows[-1]['ms_per_token']:.0f} ms/token", flush=True)

    return rows


def print_tables(rows: list[dict[str, Any]], decoders: dict[str, Decoder], qids: list[str]) -> None:
    """The per-variant medians against fp32, and where each variant's plain output parts from fp32's."""

    def cell(qid: str, target: str, rule: str) -> dict[str, Any]:
        return next(r for r in rows if (r["qid"], r["target"], r["rule"]) == (qid, target, rule))

    print(
        "\n| target | plain ms/token | MARS ms/token | MARS vs own plain | MARS tau "
        "| plain vs fp32 | MARS vs fp32 |"
    )
    print("|---|---|---|---|---|---|---|")
    for target in decoders:
        ms = {rule: statistics.median(cell(q, target, rule)["ms_per_token"] for q in qids) for rule in RULES}
        speedup = statistics.median(
            cell(q, target, "plain")["ms_per_token"] / cell(q, target, "mars")["ms_per_token"] for q in qids
        )
        tau = statistics.median(cell(q, target, "mars")["tau"] for q in qids)
        vs_fp32 = {
            rule: statistics.median(
                cell(q, "fp32", rule)["ms_per_token"] / cell(q, target, rule)["ms_per_token"] for q in qids
            )
            for rule in RULES
        }
        print(
            f"| {target} | {ms['plain']:.0f} | {ms['mars']:.0f} | {speedup:.2f}x | {tau:.2f} "
            f"| {vs_fp32['plain']:.2f}x | {vs_fp32['mars']:.2f}x |"
        )
    print()
    for target in list(decoders)[1:]:
        parted = [
            first_difference(cell(q, "fp32", "plain")["token_ids"], cell(q, target, "plain")["token_ids"])
            for q in qids
        ]
        same = sum(p is None for p in parted)
        print(
            f"{target} plain vs fp32 plain: {same}/{len(qids)} outputs identical; "
            f"first differing token of the others: {sorted(p for p in parted if p is not None)}"
        )


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--questions", default="humaneval:4,gsm8k:4", help="TASK:N,... (the first N of each)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    add_threads(parser)
    parser.add_argument(
        "--variants",
        default="fp32,int8",
        help=f"comma-separated, from fp32, {', '.join(VARIANTS)} (fp32 always runs)",
    )
    parser.add_argument("--out", type=Path, help="write the per-decode measurements here as JSON")
    args = parser.parse_args()
    names = ["fp32", *(v for v in args.variants.split(",") if v != "fp32")]
    unknown = [v for v in names[1:] if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}: choose from fp32, {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)

    decoders = {"fp32": Decoder(DEFAULT_TARGET, DEFAULT_DRAFT, dtype="fp32", threads=args.threads)}
    assert decoders["fp32"].drafter is not None
    shared_draft = decoders["fp32"].drafter.draft_model  # already int8: a loaded model is used as it is
    for name in names[1:]:
        decoders[name] = VARIANTS[name](shared_draft)
    questions = [
        q
        for spec in args.questions.split(",")
        for q in load_task(spec.split(":")[0], int(spec.split(":")[1]))
    ]
    rows = decode_all(decoders, questions, args.max_new_tokens)
    print_tables(rows, decoders, [q.qid for q in questions])
    if args.out:
        meta = {
            **machine(),
            "target": DEFAULT_TARGET,
            "draft": DEFAULT_DRAFT,
            "threads": args.threads,
            "max_new_tokens": args.max_new_tokens,
            "variants": list(decoders),
        }
        write_json(args.out, {"meta": meta, "decodes": rows})


if __name__ == "__main__":
    main()
