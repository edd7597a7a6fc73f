r"""The Q4_K kernel's arithmetic rate with its weights in the cache, against the VNNI units' own rate.

One layer of the 1.5B target (default 8960 x 1536, 8 MB of Q4_K blocks: it stays in a 32 MB L3) is
called again and again, so memory is out of the way: the kernel's multiply-accumulates a second (GMAC/s)
at each row count are what its instruction mix allows. Then the peak: a loop of independent 512-bit
``vpdpbusd`` (64 multiply-accumulates each, twelve accumulators) on each of ``--threads`` threads at once,
compiled here. Their ratio says how much of the units the kernel keeps busy once rows make it
compute-bound.

    python benchmarks/q4k_compute_rate.py --rows 1,4,8,12,16,24

A timing: run it alone on the machine.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch
from _common import add_threads, machine, script_parser

from marspec.backends.kernels import kernels_available
from marspec.backends.q4k import Q4KLinear

# Twelve independent dot-product chains per thread, on every thread at once; returns G vpdpbusd a second
# (all threads together).
PEAK_SOURCE = r"""
#include <chrono>
#include <thread>
#include <vector>

double vnni_rate(int64_t threads, int64_t loops) {
  auto work = [loops]() {
    long n = loops;
    __asm__ volatile(
        "vpxord %%zmm1, %%zmm1, %%zmm1\n vpxord %%zmm2, %%zmm2, %%zmm2\n"
        "1:\n"
        "vpdpbusd %%zmm2, %%zmm1, %%zmm3\n vpdpbusd %%zmm2, %%zmm1, %%zmm4\n"
        "vpdpbusd %%zmm2, %%zmm1, %%zmm5\n vpdpbusd %%zmm2, %%zmm1, %%zmm6\n"
        "vpdpbusd %%zmm2, %%zmm1, %%zmm7\n vpdpbusd %%zmm2, %%zmm1, %%zmm8\n"
        "vpdpbusd %%zmm2, %%zmm1, %%zmm9\n vpdpbusd %%zmm2, %%zmm1, %%zmm10\n"
        "vpdpbusd %%zmm2, %%zmm1, %%zmm11\n vpdpbusd %%zmm2, %%zmm1, %%zmm12\n"
        "vpdpbusd %%zmm2, %%zmm1, %%zmm13\n vpdpbusd %%zmm2, %%zmm1, %%zmm14\n"
        "dec %0\n jnz 1b\n"
        : "+r"(n)
        :
        : "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9", "zmm10", "zmm11", "zmm12",
          "zmm13", "zmm14");
  };
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) pool.emplace_back(work);
  for (auto& thread : pool) thread.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return threads * loops * 12 / seconds / 1e9;
}
"""


def peak_gmacs(threads: int) -> float:
    """The VNNI units' multiply-accumulates a second over ``threads`` threads (the median of 5 runs)."""
    from torch.utils.cpp_extension import load_inline

    with tempfile.TemporaryDirectory() as build:
        module = load_inline(
            name="vnni_peak",
            cpp_sources=[PEAK_SOURCE],
            functions=["vnni_rate"],
            extra_cflags=["-O2", "-mavx512f", "-mavx512vnni"],
            build_directory=build,
        )
        rates = [module.vnni_rate(threads, 50_000_000) for _ in range(5)]
    return statistics.median(rates) * 64


def main() -> None:
    parser = script_parser(__doc__)
    add_threads(parser)
    parser.add_argument("--shape", default="8960x1536", help="N x K of the layer (default 8960x1536)")
    parser.add_argument("--rows", default="1,4,8,12,16,24", help="M,... rows per call")
    args = parser.parse_args()
    if not kernels_available():
        raise SystemExit("the Q4_K kernel does not build or run here")
    torch.set_num_threads(args.threads)
    n, k = (int(v) for v in args.shape.split("x"))
    layer = Q4KLinear.from_float(torch.randn(n, k) * 0.02, None)
    peak = peak_gmacs(args.threads)
    print(machine().get("cpu", ""), f"{args.threads} threads: VNNI peak {peak:.0f} GMAC/s")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, k)
        for _ in range(20):
            layer(x)
        seconds = []
        for _ in range(15):
            start = time.perf_counter()
            for _ in range(50):
                layer(x)
            seconds.append((time.perf_counter() - start) / 50)
        call = statistics.median(seconds)
        gmacs = n * k * rows / call / 1e9
        print(f"{n}x{k}, {rows} rows: {call * 1e3:.3f} ms, {gmacs:.0f} GMAC/s ({gmacs / peak:.0%} of peak)")


if __name__ == "__main__":
    main()
