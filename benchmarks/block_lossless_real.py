"""Is block verification lossless on the real default pair, as it runs in a benchmark?

The default target (fp32) and draft (int8, confidence stop 0.4) at k=12 and temperature 1, the settings
of round three's sampled comparison. A greedy answer to an arithmetic word problem (written for this
check, not from an evaluation set) gives contexts where the target is unsure of the next token (top
probability 0.35-0.75); at two of them the script decodes from fixed seeds and counts the first emitted
token and the first two, then sets the counts against the target's exact distribution there (one
forward per first token) with a chi-square test. Block verification's first token comes from the whole
block's decision (an accepted draft, or the residual at row 0 when it stops before any), so a wrong stop
probability anywhere in the block shows in it. Strict (token-by-token speculative sampling, lossless)
runs beside it at half the trials as a control of the test.

    PYTHONPATH=src python benchmarks/block_lossless_real.py --trials 500 --out block_lossless.json

1.3-1.8 s a trial on 2 cores of an AMD EPYC family 25: 500 trials of block and 250 of strict at each
of the two contexts, ~45 min (docs/results.md, "Round three, sampled", has its numbers).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import torch
from _common import script_parser, write_json  # this folder's shared helpers

from marspec.api import Decoder
from marspec.decode import DecodeConfig, decode
from marspec.prompting import encode_prompt
from marspec.rules import Rule
from marspec.stats import GenerationStats

QUESTION = (
    "A baker makes 14 trays of muffins with 9 muffins on each tray. She sells 87 muffins in the "
    "morning and gives 11 to a school. How many muffins does she have left?"
)
K = 12
MIN_EXPECTED = 5  # a cell is tested on its own when it expects at least this many counts


def chi_square(observed: list, cells: dict) -> tuple[float, int]:
    """Pearson's statistic of ``observed`` values over ``cells`` (value -> probability) and one cell for
    everything else; and its degrees of freedom."""
    total = len(observed)
    counts = Counter(observed)
    stat, other_p, other_count = 0.0, 1.0, total
    for cell, prob in cells.items():
        count = counts[cell]
        stat += (count - prob * total) ** 2 / (prob * total)
        other_p -= prob
        other_count -= count
    if other_p * total > 0:
        stat += (other_count - other_p * total) ** 2 / (other_p * total)
    return stat, len(cells)


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--trials", type=int, default=500)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    decoder = Decoder(draft_quant="int8", draft_confidence=0.4, threads=2)
    target, drafter, tokenizer = decoder.target, decoder.drafter, decoder.tokenizer
    prompt = encode_prompt(tokenizer, QUESTION, True, target.name)

    def next_distribution(ids: torch.Tensor) -> torch.Tensor:
        target.reset()
        return torch.softmax(target.forward(ids, last_only=True)[-1].double(), -1)

    greedy = [
        t
        for step in decode(
            target, None, prompt, DecodeConfig(rule=Rule(), k=1, max_new_tokens=80), GenerationStats()
        )
        for t in step.tokens
    ]
    answer = torch.cat([prompt, torch.tensor(greedy)])
    target.reset()
    probs = torch.softmax(target.forward(answer, last_only=False).double(), -1)
    unsure = [i for i in range(len(prompt) - 1, len(answer) - 1) if 0.35 <= float(probs[i].max()) <= 0.75]
    results = {}
    for position in (unsure[0], unsure[len(unsure) // 2]):
        context = answer[: position + 1]
        first = next_distribution(context)
        top = torch.topk(first, 12)
        first_cells = {
            int(t): float(p)
            for t, p in zip(top.indices, top.values, strict=True)
            if p * args.trials >= MIN_EXPECTED
        }
        pair_cells = {}
        for x in list(first_cells)[:4]:
            second = next_distribution(torch.cat([context, torch.tensor([x])]))
            for p, y in zip(*torch.topk(second, 6), strict=True):
                if first_cells[x] * float(p) * args.trials >= MIN_EXPECTED:
                    pair_cells[x, int(y)] = first_cells[x] * float(p)
        label = f"after {position - len(prompt) + 1} tokens"
        print(f"{label}: {tokenizer.decode(context[len(prompt) :])!r}", flush=True)
        for rule in ("block", "strict"):
            trials = args.trials if rule == "block" else args.trials // 2
            firsts, pairs, accepted, drafted = [], [], [], []
            target.reset()
            drafter.reset()
            started = time.perf_counter()
            config = DecodeConfig(rule=Rule(rule), k=K, max_new_tokens=40, temperature=1.0)
            for seed in range(trials):
                emitted: list[int] = []
                generator = torch.Generator().manual_seed(10_000 + seed)
                for j, step in enumerate(
                    decode(target, drafter, context, config, GenerationStats(), generator)
                ):
                    if j == 0:
                        accepted.append(step.accepted)
                        drafted.append(step.drafted)
                    emitted.extend(step.tokens)
                    if len(emitted) >= 2:
                        break
                firsts.append(emitted[0])
                pairs.append((emitted[0], emitted[1]))
            chi_first, df_first = chi_square(firsts, first_cells)
            chi_pair, df_pair = chi_square(pairs, pair_cells)
            results[f"{label}/{rule}"] = {
                "trials": trials,
                "seconds": round(time.perf_counter() - started, 1),
                "first_cells": {tokenizer.decode([c]): round(p, 4) for c, p in first_cells.items()},
                "chi2_first": round(chi_first, 2),
                "df_first": df_first,
                "chi2_pair": round(chi_pair, 2),
                "df_pair": df_pair,
                "mean_accepted": sum(accepted) / trials,
                "mean_drafted": sum(drafted) / trials,
            }
            print(f"  {rule}: {results[f'{label}/{rule}']}", flush=True)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
