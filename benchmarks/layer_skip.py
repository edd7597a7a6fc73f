"""Would a draft that skips some of its layers pay? Teacher-forced agreement with the target's tokens.

    python benchmarks/layer_skip.py [RUN_DIR] [--method strict] [--questions 10] [--threads 2]

A draft token costs about as much as the bytes of the draft's weights it reads (docs/results.md,
"Engine: routes to a cheaper draft token"), so a draft that skips some of its 24 layers is cheaper by
roughly the share it skips. What it costs in acceptance is measured here without decoding: for the first
N questions of a whole greedy run, the int8 draft reads prompt + output (the target's own tokens when the
method is strict) in one forward, and at each output position its greedy token either equals the
target's next token or not. Reported: the share that agree (a draft token's chance to be accepted) and
the mean run of agreements from a position, capped at 12 (what one step accepts on average: tau - 1).
First each single layer skipped, then the n least harmful together, chosen on these same questions (so
an optimistic bound); and the draft's ms/token with those layers skipped (median of 40 steps; run on a
quiet machine).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
from _common import add_threads, script_parser  # this folder's shared helpers
from draft_routes import draft_steps  # this folder's script (run from it, it is on the path)

from marspec.api import load_lm
from marspec.backends.hf import HFCausalLM
from marspec.backends.quantize import quantize_int8
from marspec.defaults import DEFAULT_K
from marspec.eval.datasets import load_task
from marspec.eval.rundir import load_records, whole_run
from marspec.models.registry import DEFAULT_DRAFT
from marspec.prompting import encode_prompt

RUN = Path(__file__).parents[1] / "docs" / "results" / "rivals-greedy-humaneval-30"
MAX_RUN = DEFAULT_K  # a step drafts at most k tokens


def committed(run: Path, method: str, limit: int) -> tuple[list[list[int]], str]:
    """The output token ids of ``method``'s first ``limit`` questions in a whole run, and its task."""
    config, _ = whole_run(run)
    records = load_records(run)
    questions = load_task(config.task, limit)
    missing = [q.qid for q in questions if (q.qid, method, 0) not in records]
    if missing:
        sys.exit(f"{run} has no {method} record for {', '.join(missing)}")
    return [records[q.qid, method, 0]["turns"][0]["token_ids"] for q in questions], config.task


def agreement(lm: HFCausalLM, sequences: list[tuple[torch.Tensor, int]]) -> tuple[float, float]:
    """Share of output positions where the draft's greedy token is the next token, and the mean run of
    agreements starting at a position (capped at MAX_RUN)."""
    agree: list[bool] = []
    runs: list[int] = []
    for ids, prompt_len in sequences:
        with torch.inference_mode():
            logits = lm.model(input_ids=ids[None], use_cache=False).logits[0]  # [L, V]
        hits = (logits[prompt_len - 1 : -1].argmax(-1) == ids[prompt_len:]).tolist()
        agree += hits
        for start in range(len(hits)):
            n = 0
            while n < MAX_RUN and start + n < len(hits) and hits[start + n]:
                n += 1
            runs.append(n)
    return sum(agree) / len(agree), statistics.mean(runs)


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("run", nargs="?", type=Path, default=RUN)
    parser.add_argument("--method", default="strict")
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    add_threads(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    outputs, task = committed(args.run, args.method, args.questions)
    lm, chat = load_lm(args.draft, torch.float32)
    quantize_int8(lm.model)
    sequences = []
    for question, tokens in zip(load_task(task, args.questions), outputs, strict=True):
        prompt = encode_prompt(lm.tokenizer, question.turns[0], chat, lm.name)
        sequences.append((torch.cat([prompt, torch.tensor(tokens)]), len(prompt)))
    layers = lm.model.model.layers
    every = list(range(len(layers)))

    def keep(skipped: set[int]) -> None:
        lm.model.model.layers = torch.nn.ModuleList(layers[i] for i in every if i not in skipped)

    share, run = agreement(lm, sequences)
    positions = sum(len(ids) - p for ids, p in sequences)
    print(f"{len(sequences)} questions, {positions} positions of {args.method}'s outputs in {args.run.name}")
    print(f"all {len(layers)} layers: agreement {share:.1%}, mean run {run:.2f}")
    single = {}
    for i in every:
        keep({i})
        single[i] = agreement(lm, sequences)
        print(f"without layer {i:2d}: agreement {single[i][0]:.1%}, mean run {single[i][1]:.2f}", flush=True)
    order = sorted(every, key=lambda i: -single[i][1])
    prompt = sequences[0][0][: sequences[0][1]]
    keep(set())
    full_ms, _ = draft_steps(lm, prompt)
    print(f"\n| layers skipped | which | agreement | mean run | draft ms/token (all layers: {full_ms:.1f}) |")
    print("|---|---|---|---|---|")
    for n in (1, 2, 4, 6, 8):
        skipped = set(order[:n])
        keep(skipped)
        share, run = agreement(lm, sequences)
        print(
            f"| {n} | {sorted(skipped)} | {share:.1%} | {run:.2f} | {draft_steps(lm, prompt)[0]:.1f} |",
            flush=True,
        )
    keep(set())


if __name__ == "__main__":
    main()
