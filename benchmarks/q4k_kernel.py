r"""The Q4_K x int8 kernel (:class:`~marspec.backends.q4k.Q4KLinear`), or with ``--format q6k`` the Q6_K
one (:class:`~marspec.backends.q6k.Q6KLinear`), against the int8 layer the CPU engine runs
(:class:`~marspec.backends.int8.RowwiseInt8Linear`), on the 1.5B Qwen target's shapes of the format's
layers.

Both layers hold the same weights (random ones quantised to Q4_K, or random Q6_K blocks; dequantised
for the int8 layer). Per
shape N x K and rows M: the median milliseconds of a call, over rounds that take every (shape, M,
layer) in turn so a slow stretch of the machine lands on all alike, and for M = 1 the weight bytes each
layer reads per millisecond (GB/s). Calls cycle through copies of a layer holding at least
``--footprint-mb`` of weights, so that they come from memory, as a model's do, not from the cache.

    python benchmarks/q4k_kernel.py --out q4k-kernel.json
    python benchmarks/q4k_kernel.py --format q6k --rows 1,13 --out q6k-kernel.json
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from _common import add_threads, machine, script_parser, write_json  # this folder's shared helpers

from marspec.backends.int8 import RowwiseInt8Linear, int8_rows
from marspec.backends.kernels import kernels_available
from marspec.backends.q4k import Q4KLinear, dequantize_q4k, q4k_blocks
from marspec.backends.q6k import Q6K_BLOCK_BYTES, Q6KLinear, dequantize_q6k

ROWS = (1, 13, 52, 128)


class Format(NamedTuple):
    """A GGUF block format the kernels run: its layers' shapes in the target, random blocks of a shape,
    the kernel's layer and the dequantiser."""

    shapes: tuple[tuple[int, int], ...]  # N x K
    blocks: Callable[[int, int], np.ndarray]
    layer: type[torch.nn.Module]
    dequantize: Callable[[np.ndarray], torch.Tensor]


def random_q6k(n: int, k: int) -> np.ndarray:
    """Random Q6_K blocks [n, k / 256 * 210]: any codes and scales, d ~ 1e-4 (weights ~ 0.01)."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(n, k // 256, Q6K_BLOCK_BYTES), dtype=np.uint8)
    blocks[..., 208:210] = rng.uniform(-2e-4, 2e-4, size=(n, k // 256, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


FORMATS = {
    "q4k": Format(
        ((1536, 1536), (256, 1536), (8960, 1536), (1536, 8960), (151936, 1536)),
        lambda n, k: q4k_blocks(torch.randn(n, k) * 0.02),
        Q4KLinear,
        dequantize_q4k,
    ),
    # The target's Q6_K tensors: the tied LM head / embedding, half the ffn_down, every attn_v.
    "q6k": Format(((151936, 1536), (1536, 8960), (256, 1536)), random_q6k, Q6KLinear, dequantize_q6k),
}


def weight_bytes(layer: torch.nn.Module) -> int:
    if isinstance(layer, (Q4KLinear, Q6KLinear)):
        return layer.blocks.numel()
    return layer.out_features * layer.in_features + 4 * layer.out_features  # int8 and a scale a row


def copies(make: Callable[[], torch.nn.Module], footprint_mb: float) -> list[torch.nn.Module]:
    """Copies of the layer ``make`` builds, enough to hold ``footprint_mb`` of weights (at least one)."""
    first = make()
    count = max(1, math.ceil(footprint_mb * 1e6 / weight_bytes(first)))
    return [first, *(make() for _ in range(count - 1))]


def main() -> None:
    parser = script_parser(__doc__)
    add_threads(parser)
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--min-ms", type=float, default=20.0, help="least time a timing covers (default 20)")
    parser.add_argument(
        "--footprint-mb", type=float, default=256.0, help="weights each layer's copies hold (default 256)"
    )
    parser.add_argument("--format", choices=sorted(FORMATS), default="q4k", help="the kernel (default q4k)")
    parser.add_argument("--shapes", help="NxK,... output by input features (default: the 1.5B target's)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="M,... rows per call")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels_available():
        raise SystemExit("the Q4_K kernel is unavailable here (see the log)")

    form = FORMATS[args.format]
    kernel = args.format
    shapes = (
        form.shapes
        if args.shapes is None
        else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    )
    all_rows = [int(m) for m in args.rows.split(",")]
    torch.manual_seed(0)
    layers: dict[tuple[int, int], dict[str, list[torch.nn.Module]]] = {}
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    for n, k in shapes:
        raw = form.blocks(n, k)
        packed = form.layer.from_gguf_blocks(raw)
        int8 = int8_rows(form.dequantize(raw))
        layers[n, k] = {
            kernel: copies(
                lambda held=packed.tensors: form.layer(**{name: t.clone() for name, t in held.items()}),
                args.footprint_mb,
            ),
            "int8": copies(lambda held=int8: RowwiseInt8Linear(*held), args.footprint_mb),
        }
        for m in all_rows:
            inputs[m, k] = torch.randn(m, k)

    def calls_per_timing(layer: list[torch.nn.Module], x: torch.Tensor) -> int:
        start = time.perf_counter()
        layer[0](x)
        return max(len(layer), round(args.min_ms / 1000 / max(time.perf_counter() - start, 1e-6)))

    cases = [(shape, m, name) for shape in shapes for m in all_rows for name in (kernel, "int8")]
    with torch.inference_mode():
        counts = {
            case: calls_per_timing(layers[case[0]][case[2]], inputs[case[1], case[0][1]]) for case in cases
        }
        times: dict[Any, list[float]] = {case: [] for case in cases}
        for _ in range(args.rounds):
            for case in cases:
                (n, k), m, name = case
                layer, x = layers[n, k][name], inputs[m, k]
                start = time.perf_counter()
                for call in range(counts[case]):
                    layer[call % len(layer)](x)
                times[case].append((time.perf_counter() - start) * 1000 / counts[case])

    rows = []
    columns = (f"{kernel} ms", "int8 ms", f"int8/{kernel}", f"{kernel} GB/s", "int8 GB/s")
    print(f"{'N x K':>13} {'M':>4} " + " ".join(f"{c:>9}" for c in columns))
    for (n, k), m in ((shape, m) for shape in shapes for m in all_rows):
        ms = {name: statistics.median(times[(n, k), m, name]) for name in (kernel, "int8")}
        rates = {name: weight_bytes(layers[n, k][name][0]) / ms[name] / 1e6 for name in ms} if m == 1 else {}
        rows.append({"n": n, "k": k, "m": m, "ms": ms, "gb_per_s": rates})
        shown = [f"{rates[name]:9.1f}" if rates else f"{'':>9}" for name in (kernel, "int8")]
        print(
            f"{f'{n}x{k}':>13} {m:>4} {ms[kernel]:9.3f} {ms['int8']:9.3f} {ms['int8'] / ms[kernel]:9.2f} "
            + " ".join(shown)
        )
    if args.out:
        write_json(args.out, {"machine": machine(), "format": kernel, "rounds": args.rounds, "results": rows})


if __name__ == "__main__":
    main()
