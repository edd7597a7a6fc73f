"""Step cost against context length: transformers' DynamicCache (a copy per append) against marspec's
position cache (appends write in place), on the real default pair as the loop uses it. With ``--gqa``,
the position cache with grouped key/value heads under a mask (marspec's attention on the CPU,
``marspec.backends.hf.GROUPED_SDPA``) against transformers' SDPA, which expands them to every query head,
toggled per step in one process.

For each context length the cache is filled with random keys and values of the model's shapes (a step's
cost depends on how many positions are cached, not on their values, and prefilling 4,096 real tokens on
a 2-core CPU takes minutes), then one loop step is timed the way decode() runs it:
- draft: a one-token append followed by another (a drafted token), then a rollback of both;
- target: a 13-token verification append (pending token + k = 12 drafts), then a rollback of 12.
Both caches run on the same model weights, interleaved, so the machine's noise hits both alike.

    python benchmarks/kv_cache.py [--contexts 256,512,1024,2048,4096] [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import statistics
import time

import torch
from _common import add_threads, machine, script_parser, write_json  # this folder's shared helpers

from marspec import Decoder
from marspec.backends import HFCausalLM
from marspec.backends.hf import GROUPED_SDPA
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET


@torch.inference_mode()
def fill(lm: HFCausalLM, context: int, gen: torch.Generator) -> None:
    """Reset ``lm`` and make its cache hold ``context`` positions of random keys and values."""
    lm.reset()
    lm.forward(torch.zeros(1, dtype=torch.long))  # creates every layer's cache with the real shapes
    for layer in lm._cache.layers:
        batch, heads, _, dim = layer.keys.shape
        keys = torch.randn(batch, heads, context - 1, dim, generator=gen, dtype=layer.keys.dtype)
        layer.update(keys, torch.randn(keys.shape, generator=gen, dtype=keys.dtype))
    lm._record_ids(torch.zeros(context - 1, dtype=torch.long))  # their token ids, as a forward notes them
    lm._cached = context


def draft_step(lm: HFCausalLM) -> float:
    base = lm.cached_len
    start = time.perf_counter()
    lm.forward(torch.tensor([11]))
    lm.forward(torch.tensor([12]))
    lm.rollback(base)
    return (time.perf_counter() - start) / 2  # per drafted token


def verify_step(lm: HFCausalLM) -> float:
    base = lm.cached_len
    start = time.perf_counter()
    lm.forward(torch.arange(100, 113))
    lm.rollback(base + 1)
    elapsed = time.perf_counter() - start
    lm.rollback(base)
    return elapsed


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--contexts", default="256,512,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=7)
    add_threads(parser)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--gqa", action="store_true", help="compare grouped vs expanded heads instead")
    parser.add_argument("--json", help="also write the table here")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]

    decoder = Decoder(args.target, args.draft, threads=args.threads)
    draft = decoder.drafter.draft_model
    pairs = {
        "target": (decoder.target, verify_step),
        "draft": (draft, draft_step),
    }
    gen = torch.Generator().manual_seed(0)
    rows = []
    for role, (lm, step) in pairs.items():
        if args.gqa:  # one model and cache; the attention path is switched per step
            kinds = {"grouped": lm, "expanded": lm}
        else:
            kinds = {
                "position": lm,
                "dynamic": HFCausalLM(lm.model, lm.tokenizer, lm.name, position_cache=False),
            }
        for context in contexts:
            times: dict[str, list[float]] = {kind: [] for kind in kinds}
            for model in kinds.values():
                fill(model, context, gen)
                step(model)  # warm-up
            for _ in range(args.repeats):
                for kind, model in kinds.items():  # interleaved
                    if args.gqa:
                        lm.model.set_attn_implementation(GROUPED_SDPA if kind == "grouped" else "sdpa")
                    times[kind].append(step(model))
            row = {"model": role, "context": context}
            row.update({f"{kind}_ms": 1000 * statistics.median(ts) for kind, ts in times.items()})
            rows.append(row)
            old, new = ("expanded", "grouped") if args.gqa else ("dynamic", "position")
            print(
                f"{role:6s} {context:5d} positions: {old} {row[f'{old}_ms']:7.2f} ms, "
                f"{new} {row[f'{new}_ms']:7.2f} ms ({row[f'{old}_ms'] / row[f'{new}_ms']:.2f}x)",
                flush=True,
            )
            for model in kinds.values():
                model.reset()
    if args.json:
        write_json(args.json, {**machine(), "rows": rows})


if __name__ == "__main__":
    main()
