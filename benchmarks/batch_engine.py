"""The library's batched decoding against one prompt at a time, same process, same pair (issue 69).

Loads the default pair as a CPU user gets it (the int8 engine, a 4-bit draft), then decodes the demo's
prompts (marspec.demo.DEMO_PROMPTS, repeated to fill the batch) one at a time with ``Decoder.generate``
and together with ``Decoder.generate_many`` at each ``--batch`` size, for each rule asked; reports
aggregate tok/s, the ratio to one at a time, and whether every output equals its solo one. Writes JSON.

    python benchmarks/batch_engine.py --batch 1 2 4 8 --rules strict mars --max-new-tokens 128 \\
        --out docs/results/batch-engine.json
"""

from __future__ import annotations

import time
from pathlib import Path

from _common import add_threads, git_commit, machine, script_parser, write_json  # this folder's helpers

import marspec
from marspec.demo import DEMO_PROMPTS


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rules", nargs="+", default=["strict", "mars"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-quant", default=None, help="the draft's precision (default: the library's)")
    parser.add_argument("--out", type=Path, required=True)
    add_threads(parser)
    args = parser.parse_args()
    began = time.perf_counter()
    quant = {} if args.draft_quant is None else {"draft_quant": args.draft_quant}
    decoder = marspec.Decoder(threads=args.threads, **quant)
    load_s = time.perf_counter() - began
    prompts = [[{"role": "user", "content": text}] for _, text in DEMO_PROMPTS]
    decoder.generate(prompts[0], max_new_tokens=8)  # warm-up
    runs = []
    for rule in args.rules:
        options = {"rule": rule, "max_new_tokens": args.max_new_tokens}
        for size in args.batch:
            batch = [prompts[i % len(prompts)] for i in range(size)]
            start = time.perf_counter()
            alone = [decoder.generate(p, **options) for p in batch]
            alone_s = time.perf_counter() - start
            start = time.perf_counter()
            together = decoder.generate_many(batch, max_batch=size, **options)
            together_s = time.perf_counter() - start
            tokens = sum(len(r.token_ids) for r in together)
            run = {
                "rule": rule,
                "batch": size,
                "tokens": tokens,
                "one_at_a_time_s": alone_s,
                "together_s": together_s,
                "one_at_a_time_tok_s": sum(len(r.token_ids) for r in alone) / alone_s,
                "together_tok_s": tokens / together_s,
                "speedup": alone_s / together_s,
                "outputs_equal": [a.token_ids == t.token_ids for a, t in zip(alone, together, strict=True)],
            }
            runs.append(run)
            print(
                f"{rule} x{size}: {run['one_at_a_time_tok_s']:.2f} -> {run['together_tok_s']:.2f} tok/s "
                f"({run['speedup']:.2f}x), equal: {all(run['outputs_equal'])}",
                flush=True,
            )
            write_json(
                args.out,
                {
                    "command": "python benchmarks/batch_engine.py",
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "target_weights": decoder.target_weights,
                    "draft_weights": decoder.draft_weights,
                    "load_s": load_s,
                    "commit": git_commit(),
                    "machine": machine(),
                    "runs": runs,
                },
            )


if __name__ == "__main__":
    main()
