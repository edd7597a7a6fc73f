r"""Tuning a path's linear kernels (AVX-512 unless ``--path`` names another): builds of the same
sources with other register blocking (rows kept in registers at once, ``MARSPEC_ROW_BLOCK``), another
choice between reading a record's codes in each block of rows or unpacking them once
(``MARSPEC_BLOCKS_FROM_RECORD``), other weight requests (how many records ahead,
``MARSPEC_RECORDS_AHEAD``, into which cache level, ``MARSPEC_PREFETCH_LEVEL``, all at a record's start
or spread over its sub-blocks, ``MARSPEC_SPREAD_REQUESTS``), products summed in int16 pairs or not
(``MARSPEC_PAIR_SUMS``), and Q6_K's codes, costly to unpack, read from the record by another number of
blocks (``MARSPEC_COSTLY_BLOCKS_FROM_RECORD``), each loaded beside the others in one process (a namespace
of its own), checked bit for bit against the shipped build, and timed in interleaved rounds on the 1.5B
target's largest layer shapes at 1 and 13 rows. A variant is
ROWBLOCK:FROMRECORD[:AHEAD:LEVEL[:PAIRS[:SPREAD[:COSTLY]]]] (AVX-512 ships 6:3:2:2:0:1:3, AVX2
2:3:2:2:1:1:1; without PAIRS or COSTLY, the path's own; 6:3:1:1 the next record into every level).

    python benchmarks/kernel_variants.py --variants 6:3,7:3,6:1,4:1 --rows 1,13
    python benchmarks/kernel_variants.py --variants 6:3:2:2,6:3:1:1,6:3:1:2,6:3:3:2 --rows 1,4,13
    python benchmarks/kernel_variants.py --path avx2 --variants 2:3:2:2:0,2:3:2:2:1,3:3:2:2:1 --rows 1,4,13
    python benchmarks/kernel_variants.py --variants 6:3:2:2:0:0,6:3:2:2:0:1 --rows 1,4,13 --rounds 10
    python benchmarks/kernel_variants.py --variants 6:3:2:2:0,6:3:2:2:1 --rows 1,4,13 --rounds 7
    python benchmarks/kernel_variants.py --path avx2 --variants 2:3:2:2:1:1:3,2:3:2:2:1:1:1 --rows 1,3,5,8
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from _common import add_threads, machine, script_parser, write_json  # this folder's shared helpers
from kernel_paths import copies, packed

from marspec.backends import kernels
from marspec.backends.kernels.build import load_library
from marspec.backends.kernels.library import SOURCES, build_flags

SHAPES = (("q4k", 8960, 1536), ("q4k", 1536, 8960), ("q6k", 1536, 8960), ("q6k", 151936, 1536))


def variant_ops(
    path: str,
    row_block: int,
    from_record: int,
    ahead: int = 2,
    level: int = 2,
    pairs: int | None = None,
    spread: int = 1,
    costly_from_record: int | None = None,
) -> Any:
    """``path``'s operators built with ``row_block`` rows in registers, codes read from the record by up
    to ``from_record`` blocks of rows, the weights requested ``ahead`` records ahead into cache level
    ``level`` (1: every level; 2: the second on), spread over a record's sub-blocks or not (``spread``),
    products summed in int16 pairs or not (``pairs``; None: the path's own), and Q6_K's codes read from
    the record by up to ``costly_from_record`` blocks (None: the path's own choice)."""
    fields = f"{row_block}:{from_record}:{ahead}:{level}:{'own' if pairs is None else pairs}:{spread}"
    if costly_from_record is not None:
        fields += f":{costly_from_record}"
    name = "marspec_v_" + path + "_" + fields.replace(":", "_")
    flags = [f for f in build_flags(kernels.path_named(path)) if not f.startswith("-DMARSPEC_OPS=")]
    flags += [
        f"-DMARSPEC_OPS={name}",
        f"-DMARSPEC_ROW_BLOCK={row_block}",
        f"-DMARSPEC_BLOCKS_FROM_RECORD={from_record}",
        f"-DMARSPEC_RECORDS_AHEAD={ahead}",
        f"-DMARSPEC_PREFETCH_LEVEL={level}",
        f"-DMARSPEC_SPREAD_REQUESTS={spread}",
    ]
    if pairs is not None:
        flags.append(f"-DMARSPEC_PAIR_SUMS={pairs}")
    if costly_from_record is not None:
        flags.append(f"-DMARSPEC_COSTLY_BLOCKS_FROM_RECORD={costly_from_record}")
    label = f"{path} variant {fields} kernels"
    load_library(name, SOURCES, flags, label=label)
    return getattr(torch.ops, name)


def main() -> None:
    parser = script_parser(__doc__)
    add_threads(parser)
    parser.add_argument("--path", default="avx512_vnni", help="the kernel path the variants are built for")
    parser.add_argument(
        "--variants",
        default="6:3,7:3,6:1,4:1",
        help="ROWBLOCK:FROMRECORD[:AHEAD:LEVEL[:PAIRS[:SPREAD[:COSTLY]]]],...",
    )
    parser.add_argument("--rows", default="1,13")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = {v: variant_ops(args.path, *map(int, v.split(":"))) for v in args.variants.split(",")}
    shipped = kernels.library_ops(kernels.path_named(args.path))
    all_rows = [int(m) for m in args.rows.split(",")]
    torch.manual_seed(0)
    layers = {shape: packed(*shape) for shape in SHAPES}
    blocks = {shape: copies(layer, 256) for shape, layer in layers.items()}
    cases = [(v, shape, m) for shape in SHAPES for m in all_rows for v in variants]
    times: dict[Any, list[float]] = {case: [] for case in cases}
    inputs = {(m, k): torch.randn(m, k) for m in all_rows for _, _, k in SHAPES}
    with torch.inference_mode():
        for v, (form, n, k), m in cases:  # every variant gives the shipped build's bits
            op, ref = (getattr(o, f"{form}_linear") for o in (variants[v], shipped))
            x = inputs[m, k]
            assert torch.equal(
                op(x, blocks[form, n, k][0], n, None), ref(x, blocks[form, n, k][0], n, None)
            ), v
        for round_ in range(args.rounds):
            # The variants in turn first: builds of the same code measured 10-30% apart in a fixed order.
            for case in cases[round_ % len(variants) :] + cases[: round_ % len(variants)]:
                v, (form, n, k), m = case
                op, held, x = getattr(variants[v], f"{form}_linear"), blocks[form, n, k], inputs[m, k]
                start, calls = time.perf_counter(), 0
                while calls < len(held) or time.perf_counter() - start < 0.03:
                    op(x, held[calls % len(held)], n, None)
                    calls += 1
                times[case].append((time.perf_counter() - start) * 1000 / calls)
    results = []
    for shape in SHAPES:
        for m in all_rows:
            base = statistics.median(times[next(iter(variants)), shape, m])
            cells = []
            for v in variants:
                ms = statistics.median(times[v, shape, m])
                results.append({"variant": v, "shape": shape, "m": m, "ms": ms})
                cells.append(f"{v} {ms:8.3f} ({ms / base:4.2f})")
            print(f"{shape[0]} {shape[1]}x{shape[2]} {m:>3} rows: " + "  ".join(cells), flush=True)
    if args.out:
        write_json(args.out, {"machine": machine(), "results": results})


if __name__ == "__main__":
    main()
