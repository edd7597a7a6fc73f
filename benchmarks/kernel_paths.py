r"""The kernel table: the Q4_K and Q6_K kernels on every CPU path this machine runs (AVX2, AVX-512 VNNI,
...; :mod:`marspec.backends.kernels`), side by side in one process, on the 1.5B Qwen target's layer shapes,
at 1, 4, 8, 13 and 16 rows a call.

Every path computes the same bits (tests/test_cpu_paths.py), so only the time differs. Per path, shape N x K
and rows M: the median milliseconds of a call, over rounds that take every case in turn (so a slow stretch
of the machine lands on all alike), the weight bytes a one-row call reads per millisecond (GB/s), and each
row count's cost in one-row calls (M = 13: what a 13-row verification costs against a one-token step).
Calls cycle through copies of a layer holding at least ``--footprint-mb`` of weights, so that they come
from memory, as a model's do. Totals over the target's layers (each shape times its count in the model)
give the whole linear part of a forward at each row count.

    python benchmarks/kernel_paths.py --out docs/results/kernel-paths-2026-12-06.json
    python benchmarks/kernel_paths.py --paths avx2 --rows 1,13
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import add_threads, machine, script_parser, write_json  # this folder's shared helpers
from q4k_kernel import random_q6k  # the Q6_K blocks q4k_kernel.py times

from marspec.backends import kernels
from marspec.backends.q4k import Q4KLinear, q4k_blocks
from marspec.backends.q6k import Q6KLinear

ROWS = (1, 4, 8, 13, 16)
# The 1.5B Qwen target's linear layers in its Q4_K_M file: (format, N, K, count in the model).
TARGET_LAYERS = (
    ("q4k", 1536, 1536, 56),  # attn_q, attn_output (28 layers each)
    ("q4k", 256, 1536, 28),  # attn_k
    ("q6k", 256, 1536, 14),  # attn_v, half the layers (the rest Q4_K)
    ("q4k", 256, 1536, 14),
    ("q4k", 8960, 1536, 56),  # ffn_gate, ffn_up
    ("q6k", 1536, 8960, 14),  # ffn_down, half the layers
    ("q4k", 1536, 8960, 14),
    ("q6k", 151936, 1536, 1),  # the output layer (tied to the embedding)
)


def packed(form: str, n: int, k: int) -> torch.nn.Module:
    if form == "q4k":
        return Q4KLinear.from_gguf_blocks(q4k_blocks(torch.randn(n, k) * 0.02))
    return Q6KLinear.from_gguf_blocks(random_q6k(n, k))


def copies(layer: torch.nn.Module, footprint_mb: float) -> list[torch.Tensor]:
    """The layer's packed blocks and clones of them, at least ``footprint_mb`` in all."""
    count = max(1, round(footprint_mb * 1e6 / layer.blocks.numel()))
    return [layer.blocks, *(layer.blocks.clone() for _ in range(count - 1))]


def main() -> None:
    parser = script_parser(__doc__)
    add_threads(parser)
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (default 9)")
    parser.add_argument("--min-ms", type=float, default=20.0, help="least time a timing covers (default 20)")
    parser.add_argument("--footprint-mb", type=float, default=256.0, help="weights each case's copies hold")
    parser.add_argument("--paths", help="path,... (default: every path this CPU runs)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="M,... rows per call")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.paths.split(",") if args.paths else [p.name for p in kernels.runnable_paths() if not p.amx]
    ops = {name: kernels.library_ops(kernels.path_named(name)) for name in names}
    all_rows = [int(m) for m in args.rows.split(",")]
    shapes = sorted({(form, n, k) for form, n, k, _ in TARGET_LAYERS})
    torch.manual_seed(0)
    layers = {shape: packed(*shape) for shape in shapes}
    blocks = {shape: copies(layer, args.footprint_mb) for shape, layer in layers.items()}
    inputs = {(m, k): torch.randn(m, k) for m in all_rows for _, _, k in shapes}

    def call(path: str, shape: tuple[str, int, int]) -> Callable[[torch.Tensor, int], Any]:
        op = ops[path].q4k_linear if shape[0] == "q4k" else ops[path].q6k_linear
        held, n = blocks[shape], shape[1]
        return lambda x, i: op(x, held[i % len(held)], n, None)

    cases = [(path, shape, m) for shape in shapes for m in all_rows for path in names]
    runs = {case: call(case[0], case[1]) for case in cases}
    with torch.inference_mode():
        counts = {}
        for case in cases:
            start = time.perf_counter()
            runs[case](inputs[case[2], case[1][2]], 0)
            counts[case] = max(
                len(blocks[case[1]]), round(args.min_ms / 1000 / max(time.perf_counter() - start, 1e-6))
            )
        times: dict[Any, list[float]] = {case: [] for case in cases}
        for _ in range(args.rounds):
            for case in cases:
                run, x = runs[case], inputs[case[2], case[1][2]]
                start = time.perf_counter()
                for i in range(counts[case]):
                    run(x, i)
                times[case].append((time.perf_counter() - start) * 1000 / counts[case])
    ms = {case: statistics.median(t) for case, t in times.items()}
    report(names, shapes, all_rows, layers, ms, args.out)


def report(
    names: list[str], shapes: list, all_rows: list[int], layers: dict, ms: dict, out: str | None
) -> None:
    """Print the table and the target's totals; write them as JSON to ``out``."""
    rows = []
    print(
        f"{'path':>12} {'format N x K':>18} "
        + " ".join(f"{f'{m} rows':>9}" for m in all_rows)
        + "    GB/s  x1-row"
    )
    for path in names:
        for shape in shapes:
            per_m = {m: ms[path, shape, m] for m in all_rows}
            rate = layers[shape].blocks.numel() / per_m[all_rows[0]] / 1e6
            ratio = {m: per_m[m] / per_m[all_rows[0]] for m in all_rows}
            rows.append(
                {
                    "path": path,
                    "format": shape[0],
                    "n": shape[1],
                    "k": shape[2],
                    "ms": per_m,
                    "gb_per_s_first": rate,
                    "in_first_rows_calls": ratio,
                }
            )
            cells = " ".join(f"{per_m[m]:9.3f}" for m in all_rows)
            label = f"{shape[0]} {shape[1]}x{shape[2]}"
            print(f"{path:>12} {label:>18} {cells} {rate:7.1f}  {ratio[all_rows[-1]]:6.2f}")
    totals = {}
    for path in names:
        total = {m: sum(ms[path, (f, n, k), m] * count for f, n, k, count in TARGET_LAYERS) for m in all_rows}
        totals[path] = total
        cells = " ".join(f"{total[m]:9.2f}" for m in all_rows)
        ratios = " ".join(f"{total[m] / total[all_rows[0]]:5.2f}" for m in all_rows)
        print(f"{path:>12} {'target, all linears':>18} {cells}  (in one-row forwards: {ratios})")
    if out:
        write_json(out, {"machine": machine(), "rows": all_rows, "results": rows, "target_totals_ms": totals})


if __name__ == "__main__":
    main()
