r"""4-bit weights against int8 and fp32 in one process (issue 57): what a forward costs, and how far the
4-bit target's greedy output follows the fp32 one's.

Forward costs: one-token steps and 5-, 9- and 13-token verifications (k = 4, 8, 12) of the default
target in fp32 (oneDNN-prepacked, the default), int8 (``target_quant="int8"``) and int4
(``target_quant="int4"``), and one-token forwards of the default draft in int8 and int4, after 256
cached positions; the variants are measured in turn, round after round, so a slow stretch of the
machine lands on all alike (medians over rounds). Divergence: plain decoding of the demo's prompts
(``marspec.demo.DEMO_PROMPTS``; its math prompt is a GSM8K *training* question, not one of the
evaluation set's) with each target, and the first token where the quantised target's output leaves the
fp32 one's. Whether the answers stay as good is a graded run's question (``marspec bench
--target-quant int4``, docs/results.md). Peak memory is per process: measure it with GNU time around
``marspec generate``.

    python benchmarks/int4_target.py --threads 2 --out docs/results/int4-target.json
    python benchmarks/int4_target.py --kernels-only --threads 1   # one layer's products, no real weights
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _common import add_threads, machine, script_parser, write_json  # this folder's shared helpers
from target_quant import first_difference  # this folder's script (run from it, it is on the path)

from marspec.api import Decoder, load_lm
from marspec.backends.quantize import quantize_draft
from marspec.demo import DEMO_PROMPTS
from marspec.interfaces import CausalLM
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET
from marspec.profile import measure

TARGETS = ("fp32", "int8", "int4")
DRAFTS = ("int8", "int4")


def interleaved_costs(
    models: dict[str, CausalLM], sizes: tuple[int, ...], rounds: int
) -> dict[str, dict[int, float]]:
    """Median seconds of a forward over n tokens for each model and n, the models measured in turn,
    round after round (each round's value itself a median of 3, after 256 cached positions)."""
    samples: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in models}
    for _ in range(rounds):
        for name, lm in models.items():
            for n, seconds in measure(lm, sizes, repeats=3).items():
                samples[name][n].append(seconds)
    return {name: {n: statistics.median(s) for n, s in by_n.items()} for name, by_n in samples.items()}


def print_costs(costs: dict[str, dict[int, float]], sizes: tuple[int, ...]) -> None:
    print("\n| model | " + " | ".join(f"{n} tokens ms" for n in sizes) + f" | {sizes[-1]} tokens / 1 |")
    print("|---|" + "---|" * (len(sizes) + 1))
    for name, by_n in costs.items():
        cells = [f"{by_n[n] * 1000:.1f}" if n in by_n else "-" for n in sizes]
        ratio = f"{by_n[sizes[-1]] / by_n[1]:.2f}" if sizes[-1] in by_n else "-"
        print(f"| {name} | {' | '.join(cells)} | {ratio} |")


# One decoder layer's products of the 1.5B target (out, in): q, k, v, o, gate, up, down.
_LAYER_SHAPES = (
    (1536, 1536),
    (256, 1536),
    (256, 1536),
    (1536, 1536),
    (8960, 1536),
    (8960, 1536),
    (1536, 8960),
)


def kernel_costs(sizes: tuple[int, ...], rounds: int) -> dict[str, dict[int, list[float]]]:
    """Seconds of one decoder layer's seven linear products (random weights of the 1.5B target's
    shapes, no attention) over n rows, per precision, the precisions measured in turn: no real weights
    needed, ~0.2 GB."""
    from marspec.backends.int4 import Int4Linear
    from marspec.backends.prepack import PrepackedLinear
    from marspec.backends.quantize import RowwiseInt8Linear

    torch.manual_seed(0)
    linears = [torch.nn.Linear(n_in, n_out) for n_out, n_in in _LAYER_SHAPES]
    for linear in linears:
        linear.weight.data.mul_(0.02)
    kinds = {"fp32 (prepacked)": PrepackedLinear, "int8": RowwiseInt8Linear, "int4": Int4Linear}
    layers = {name: [kind(linear) for linear in linears] for name, kind in kinds.items()}
    inputs = {n: {n_in: torch.randn(n, n_in) for _, n_in in _LAYER_SHAPES} for n in sizes}
    samples: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in kinds}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, products in layers.items():
                for n in sizes:
                    start = time.perf_counter()
                    for product in products:
                        product(inputs[n][product.in_features])
                    samples[name][n].append(time.perf_counter() - start)
    return samples


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    add_threads(parser)
    parser.add_argument("--rounds", type=int, default=3, help="forward-cost rounds over all variants")
    parser.add_argument(
        "--sizes", default="1,5,9,13", help="tokens scored per target forward (13: a k = 12 verification)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="plain decode length per prompt")
    parser.add_argument("--out", type=Path, help="write the measurements here as JSON")
    parser.add_argument(
        "--kernels-only",
        action="store_true",
        help="only one decoder layer's products at the 1.5B's shapes (random weights; min / median ms)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    sizes = tuple(int(n) for n in args.sizes.split(","))
    if args.kernels_only:
        samples = kernel_costs(sizes, rounds=4 * args.rounds)
        print(
            f"\n| one layer's 7 products, {args.threads} threads | "
            + " | ".join(f"{n} rows" for n in sizes)
            + " |"
        )
        print("|---|" + "---|" * len(sizes))
        for name, by_n in samples.items():
            cells = [f"{min(by_n[n]) * 1000:.1f} / {statistics.median(by_n[n]) * 1000:.1f}" for n in sizes]
            print(f"| {name} | {' | '.join(cells)} |")
        return
    targets = {
        quant: Decoder(args.target, None, target_quant="none" if quant == "fp32" else quant)
        for quant in TARGETS
    }
    costs = interleaved_costs({f"target {q}": d.target for q, d in targets.items()}, sizes, args.rounds)
    print_costs(costs, sizes)
    decodes: list[dict[str, Any]] = []
    for kind, prompt in DEMO_PROMPTS:
        for quant, decoder in targets.items():
            result = decoder.generate(prompt, rule="plain", max_new_tokens=args.max_new_tokens)
            decodes.append({"kind": kind, "prompt": prompt, "target": quant, "token_ids": result.token_ids})
            print(
                f"{kind} {quant}: {1000 * result.stats.wall_s / result.stats.new_tokens:.0f} ms/token",
                flush=True,
            )
    print()
    for quant in TARGETS[1:]:
        parted = []
        for _kind, prompt in DEMO_PROMPTS:
            ids = {d["target"]: d["token_ids"] for d in decodes if d["prompt"] == prompt}
            parted.append(first_difference(ids["fp32"], ids[quant]))
        same = sum(p is None for p in parted)
        print(
            f"{quant} plain vs fp32 plain ({args.max_new_tokens} tokens): {same}/{len(parted)} identical; "
            f"first differing token, prompt by prompt: {parted}"
        )
    # The drafts are measured on their own: the three targets and two drafts at once would take ~12 GB.
    del targets, decoder
    drafts = {}
    for quant in DRAFTS:  # as a Decoder quantises its draft (int8: fbgemm's dynamic layers)
        drafts[f"draft {quant}"], _ = load_lm(args.draft, torch.float32)
        quantize_draft(drafts[f"draft {quant}"].model, quant)
    draft_costs = interleaved_costs(drafts, (1,), args.rounds)
    print_costs(draft_costs, (1,))
    costs |= draft_costs
    if args.out:
        meta = {
            **machine(),
            "target": args.target,
            "draft": args.draft,
            "threads": args.threads,
            "rounds": args.rounds,
            "max_new_tokens": args.max_new_tokens,
        }
        forward_ms = {name: {n: s * 1000 for n, s in by_n.items()} for name, by_n in costs.items()}
        write_json(args.out, {"meta": meta, "forward_ms": forward_ms, "decodes": decodes})


if __name__ == "__main__":
    main()
