"""Drafter settings side by side: how marspec's drafting defaults were chosen.

Runs plain decoding and MARS with several drafter settings (draft precision, maximum draft length k,
confidence stop, prompt lookup, adaptive k, token trees) on the same questions, interleaved question by
question in one process, and prints time per token and speedup against plain. All settings share one
int8 copy and one fp32 copy of the draft model; --no-prepack measures torch's default linear kernels.

    python benchmarks/drafter_settings.py humaneval:3:256 gsm8k:2:320   # task:questions:max_new_tokens
    python benchmarks/drafter_settings.py humaneval:3:256 --settings "int8 k8 c.4; int8 k8 c.4 tree 2,2"
    python benchmarks/drafter_settings.py humaneval:3:256 gsm8k:2:320 --target-quant int8  # a cheaper target
"""

from __future__ import annotations

import argparse

import torch
from _common import add_threads, script_parser  # this folder's shared helpers

from marspec.api import Decoder
from marspec.backends.hf import HFCausalLM
from marspec.backends.quantize import quantize_int8
from marspec.drafters import Drafter, HybridDrafter, ModelDrafter
from marspec.eval.datasets import load_task
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model


def settings(fp32_draft: HFCausalLM, int8_draft: HFCausalLM, vocab: int) -> dict[str, tuple[Drafter, dict]]:
    """Name -> (drafter, generation options beyond the rule)."""
    confident = ModelDrafter(int8_draft, vocab, 0.4)
    return {
        "fp32 k5": (ModelDrafter(fp32_draft, vocab), {"k": 5}),
        "int8 k5": (ModelDrafter(int8_draft, vocab), {"k": 5}),
        "int8 k6 c.4": (confident, {"k": 6}),
        "int8 k8 c.4": (confident, {"k": 8}),
        "int8 k8 c.6": (ModelDrafter(int8_draft, vocab, 0.6), {"k": 8}),
        "int8 k8 c.4 +lookup": (HybridDrafter(ModelDrafter(int8_draft, vocab, 0.4)), {"k": 8}),
        "int8 k10 c.4": (confident, {"k": 10}),
        "int8 k12 c.4": (confident, {"k": 12}),
        "int8 k12 c.4 adaptive": (confident, {"k": 12, "adaptive_k": True}),
        "int8 k12 c.4 tree 2": (confident, {"k": 12, "tree": "2"}),
        "int8 k12 c.6": (ModelDrafter(int8_draft, vocab, 0.6), {"k": 12}),
        "int8 k16 c.4": (confident, {"k": 16}),
        "int8 k20 c.4": (confident, {"k": 20}),
        "int8 k16 c.4 adaptive": (confident, {"k": 16, "adaptive_k": True}),
        "int8 k8 c.4 tree 2": (confident, {"k": 8, "tree": "2"}),
        "int8 k8 c.4 tree 2,2": (confident, {"k": 8, "tree": "2,2"}),
        "int8 k8 c.4 tree 3,2": (confident, {"k": 8, "tree": "3,2"}),
    }


DEFAULT_SETTINGS = "fp32 k5; int8 k5; int8 k8 c.4; int8 k8 c.4 +lookup; int8 k12 c.4; int8 k12 c.6"


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("runs", nargs="+", help="task:questions:max_new_tokens, e.g. gsm8k:2:320")
    parser.add_argument("--rule", default="mars", choices=("strict", "mars"))
    add_threads(parser)
    parser.add_argument(
        "--prepack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="oneDNN-prepacked linear layers in the target and the fp32 draft (default: on)",
    )
    parser.add_argument(
        "--target-quant",
        default="none",
        choices=("none", "int8"),
        help="int8: the drafter settings against the int8 target, whose step costs ~0.4 of the fp32 one",
    )
    parser.add_argument(
        "--settings",
        default=DEFAULT_SETTINGS,
        help="Names from settings(), separated by semicolons (default: the first table in docs/results.md)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    decoder = Decoder(
        DEFAULT_TARGET,
        DEFAULT_DRAFT,
        draft_quant="none",
        draft_confidence=0.0,
        lookup=False,
        prepack=args.prepack,
        target_quant=args.target_quant,
    )
    fp32_draft = decoder.drafter.draft_model
    model, tokenizer, _ = load_model(DEFAULT_DRAFT, dtype=torch.float32)
    int8_draft = HFCausalLM(quantize_int8(model), tokenizer, f"{DEFAULT_DRAFT}-int8")
    every = settings(fp32_draft, int8_draft, decoder.target.vocab_size)
    chosen = [name.strip() for name in args.settings.split(";")]
    unknown = [name for name in chosen if name not in every]
    if unknown:
        parser.error(f"unknown setting(s) {unknown}: choose from {list(every)}")
    table = {name: every[name] for name in chosen}
    totals = {name: [0.0, 0, 0.0] for name in ["plain", *table]}  # wall s, tokens, draft forward s

    for run in args.runs:
        task, n, new_tokens = run.split(":")
        for question in load_task(task, int(n)):
            for name in totals:
                if name == "plain":
                    decoder.drafter, opts = None, {"rule": "plain"}
                else:
                    decoder.drafter, extra = table[name]
                    opts = {"rule": args.rule, **extra}
                result = decoder.generate(
                    question.turns[0], max_new_tokens=int(new_tokens), reuse_prefix=False, **opts
                )
                s = result.stats
                totals[name][0] += s.wall_s
                totals[name][1] += s.new_tokens
                totals[name][2] += s.draft_forward_s
                print(
                    f"{question.qid:14s} {name:20s} {s.new_tokens:4d} tok {s.wall_s:6.1f} s tau {s.tau:5.2f}"
                )

    base = totals["plain"][0] / totals["plain"][1]
    print(f"\n{'setting':20s} {'ms/token':>8s} {'speedup':>8s} {'draft share':>11s}")
    for name, (wall, tokens, draft_s) in totals.items():
        per_token = wall / tokens
        print(f"{name:20s} {per_token * 1000:8.0f} {base / per_token:7.2f}x {draft_s / wall:11.2f}")


if __name__ == "__main__":
    main()
