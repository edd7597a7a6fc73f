"""A 7-8B target's step on marspec's q4k engine and on llama.cpp, from one GGUF of that shape with random
blocks (``marspec.models.shapes``: a step's cost does not depend on the weights' values).

    python benchmarks/shapes_8b.py write qwen3-8b /tmp/qwen3-8b.gguf
    python benchmarks/shapes_8b.py marspec /tmp/qwen3-8b.gguf --cache /tmp/shape-cache   # first load
    python benchmarks/shapes_8b.py marspec /tmp/qwen3-8b.gguf --cache /tmp/shape-cache   # a later load
    /work/llama-native/bin/python benchmarks/shapes_8b.py llamacpp /tmp/qwen3-8b.gguf

Each side, in a process of its own: the load's seconds; a 64-token prompt scored; then the median of
``--steps`` one-token steps (plain decoding's forward) and of ``--steps`` 13-row forwards at the same
cache length (a verification of 12 drafts, each forward rolled back after), and their ratio; the process's
peak resident memory (VmHWM). One JSON line. The llama.cpp side needs llama-cpp-python only
(``llama_cpp_engine.Engine``); marspec's side runs the model with no precision named (the CPU default).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from _common import add_threads, script_parser

PROMPT, VERIFY = 64, 13


def peak_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def timed_steps(step, rollback, base: int, steps: int, rows: int) -> float:
    """The median seconds of ``steps`` forwards of ``rows`` tokens at cache length ``base``."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step(rows)
        times.append(time.perf_counter() - started)
        rollback(base)
    return statistics.median(times)


def run_marspec(path: str, threads: int, steps: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from marspec import Decoder

    started = time.perf_counter()
    decoder = Decoder(path, None, device="cpu", threads=threads)
    load = time.perf_counter() - started
    lm = decoder.target
    ids = torch.randint(1000, 20000, (PROMPT + VERIFY,), generator=torch.Generator().manual_seed(0))
    lm.reset()
    lm.forward(ids[:PROMPT], last_only=True)

    def step(rows: int) -> None:
        lm.forward(ids[PROMPT : PROMPT + rows])

    one = timed_steps(step, lm.rollback, PROMPT, steps, 1)
    verify = timed_steps(step, lm.rollback, PROMPT, steps, VERIFY)
    return {
        "engine": f"marspec {decoder.target_quant}",
        "direct_forward": lm.direct is not None,
        "load_s": load,
        **_result(one, verify),
    }


def run_llamacpp(path: str, threads: int, steps: int) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    import numpy as np
    from llama_cpp_engine import Engine

    started = time.perf_counter()
    engine = Engine(path, threads)
    load = time.perf_counter() - started
    ids = np.random.default_rng(0).integers(1000, 20000, PROMPT + VERIFY).tolist()
    engine.argmax(ids[:PROMPT])

    def step(rows: int) -> None:
        engine.argmax(ids[PROMPT : PROMPT + rows], every=True)

    one = timed_steps(step, engine.cut, PROMPT, steps, 1)
    verify = timed_steps(step, engine.cut, PROMPT, steps, VERIFY)
    return {"engine": "llama.cpp", "load_s": load, **_result(one, verify)}


def _result(one: float, verify: float) -> dict:
    return {
        "one_token_ms": 1000 * one,
        "plain_tok_s": 1 / one,
        f"verify_{VERIFY}_ms": 1000 * verify,
        f"verify_{VERIFY}_in_steps": verify / one,
        "peak_gb": peak_gb(),
    }


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("side", choices=("write", "marspec", "llamacpp"))
    parser.add_argument("args", nargs="+", help="write: SHAPE OUT.gguf; the others: GGUF")
    parser.add_argument("--cache", help="marspec's cache folder (MARSPEC_CACHE_DIR) for its side")
    parser.add_argument("--steps", type=int, default=9)
    add_threads(parser)
    args = parser.parse_args()
    if args.side == "write":
        from marspec.models.shapes import write_shape_gguf

        started = time.perf_counter()
        write_shape_gguf(args.args[0], Path(args.args[1]))
        print(json.dumps({"written": args.args[1], "seconds": time.perf_counter() - started}))
        return
    if args.cache:
        os.environ["MARSPEC_CACHE_DIR"] = args.cache
    run = run_marspec if args.side == "marspec" else run_llamacpp
    print(
        json.dumps(
            {"gguf": args.args[0], "threads": args.threads, **run(args.args[0], args.threads, args.steps)}
        )
    )


if __name__ == "__main__":
    main()
