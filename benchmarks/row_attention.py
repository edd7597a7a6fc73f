r"""Row-by-row attention (marspec.backends.row_attention) with the kernel (marspec_attention::rows) against
one SDPA call per row, interleaved in one process, on the default pair's head shapes: the target's 12
heads of 128 (2 key heads) and the draft's 14 of 64, 200 cached positions, 1 and 13 query rows.

    python benchmarks/row_attention.py

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
    parser.add_argument("--cached", type=int, default=200, help="cached positions before the rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = row_attention.kernel_takes
    if not kernel(torch.zeros(1, 1, 1, 16)):
        raise SystemExit("the attention kernel does not run here")
    module = torch.nn.Module()
    for heads, kv_heads, d in SHAPES:
        for rows in (1, 13):
            kv = args.cached + rows
            query = torch.randn(1, heads, rows, d)
            key = torch.randn(1, kv_heads, 2 * kv, d)[:, :, :kv]  # views of a longer cache, as in a model
            value = torch.randn(1, kv_heads, 2 * kv, d)[:, :, :kv]
            micros: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(20):
                for on in (True, False):
                    row_attention.kernel_takes = kernel if on else (lambda q: False)
                    start = time.perf_counter()
                    for _ in range(20):
                        row_by_row_attention(module, query, key, value, None, scaling=d**-0.5)
                    micros[on].append((time.perf_counter() - start) / 20 * 1e6)
            row_attention.kernel_takes = kernel
            ours, sdpa = statistics.median(micros[True]), statistics.median(micros[False])
            print(f"{heads} heads of {d}, {rows} rows: kernel {ours:.1f} us, SDPA per row {sdpa:.1f} us")


if __name__ == "__main__":
    main()
