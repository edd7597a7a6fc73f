r"""Row-by-row attention (marspec.backends.row_attention) with the kernel (marspec_attention::rows) against
one SDPA call per row, interleaved in one process, on the default pair's head shapes: the target's 12
heads of 128 (2 key heads) and the draft's 14 of 64, 200 cached positions, 1 and 13 query rows. With
``--fp16``: the kernel over an fp16 cache (what marspec's models keep) against it over a float32 one.

    python benchmarks/row_attention.py
    python benchmarks/row_attention.py --fp16 --cached 256 2048 8192

A timing: run it alone on the machine.
"""

from __future__ import annotations

import statistics
import time

import torch
from _common import add_threads, script_parser

from marspec.backends import row_attention
from marspec.backends.row_attention import row_by_row_attention

SHAPES = ((12, 2, 128), (14, 2, 64))  # query heads, key heads, head size


def main() -> None:
    parser = script_parser(__doc__)
    add_threads(parser)
    parser.add_argument(
        "--cached", type=int, nargs="+", default=[200], help="cached positions before the rows"
    )
    parser.add_argument(
        "--fp16", action="store_true", help="an fp16 cache against a float32 one, both kernel"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = row_attention.kernel_takes
    if not kernel(torch.zeros(1, 1, 1, 16)):
        raise SystemExit("the attention kernel does not run here")
    module = torch.nn.Module()
    names = ("fp16 cache", "float32 cache") if args.fp16 else ("kernel", "SDPA per row")
    for cached in args.cached:
        for heads, kv_heads, d in SHAPES:
            for rows in (1, 13):
                kv = cached + rows
                query = torch.randn(1, heads, rows, d)
                key = torch.randn(1, kv_heads, 2 * kv, d)[:, :, :kv]  # views of a longer cache, as in a model
                value = torch.randn(1, kv_heads, 2 * kv, d)[:, :, :kv]
                halves = (key.half(), value.half())
                micros: dict[bool, list[float]] = {True: [], False: []}
                repeats = max(2, 4000 // kv)
                for _ in range(20):
                    for first in (True, False):
                        row_attention.kernel_takes = kernel if first or args.fp16 else (lambda q: False)
                        keys, values = halves if first and args.fp16 else (key, value)
                        start = time.perf_counter()
                        for _ in range(repeats):
                            row_by_row_attention(module, query, keys, values, None, scaling=d**-0.5)
                        micros[first].append((time.perf_counter() - start) / repeats * 1e6)
                row_attention.kernel_takes = kernel
                a, b = statistics.median(micros[True]), statistics.median(micros[False])
                print(
                    f"{cached} cached, {heads} heads of {d}, {rows} rows: {names[0]} {a:.1f} us, "
                    f"{names[1]} {b:.1f} us ({a / b:.2f}x)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
