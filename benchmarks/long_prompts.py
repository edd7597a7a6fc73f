"""Long prompts on marspec's q4k engine and on llama.cpp, from the same GGUF: prefill speed at each prompt
length, and the one-token decode step after it (the step at 8k tokens of context against 256).

    python benchmarks/long_prompts.py gguf qwen2.5-coder-1.5b-instruct /tmp/p81   # the packaged GGUF's path
    python benchmarks/long_prompts.py marspec qwen2.5-coder-1.5b-instruct --sizes 256 512 2048 8192
    /work/llama-native/bin/python benchmarks/long_prompts.py llamacpp \
        /tmp/p81/qwen2.5-coder-1.5b-instruct.gguf --sizes 256 512 2048 8192
    python benchmarks/long_prompts.py marspec /tmp/fam/qwen3-8b.gguf --cache /tmp/fam/realcache --sizes 512
    python benchmarks/long_prompts.py marspec qwen2.5-coder-1.5b-instruct --sizes 8192 --chunk 0  # unchunked
    python benchmarks/long_prompts.py marspec qwen2.5-coder-1.5b-instruct --kv-dtypes float32 float16

For each prompt length, in one process: a prompt of random token ids scored from an empty cache (the
prefill: only its last row's logits, as generation asks), its seconds and tokens a second; then the median
of ``--steps`` one-token forwards after it (plain decoding's step at that context; each rolled back); the
process's peak resident memory during the prefill (VmHWM, reset before each prompt) and before it. One JSON
line a length, printed as it is measured. marspec runs its model with no precision named (the CPU default,
the q4k engine), prompts in chunks of ``--chunk`` tokens (its default; 0: one forward); llama.cpp runs
through ``llama_cpp_engine.Engine`` (llama-cpp-python: its default context settings but the context
length, the prompt fed in batches of 512) and needs nothing else from this repository. ``--kv-dtypes``
measures marspec's KV cache in each dtype named, one after the other in the same process (default: the
model's dtype, float32; ``HFCausalLM.kv_dtype``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from _common import add_threads, script_parser

SHORT = 256  # the context of the one-token step each long-context step is compared with


def memory_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def reset_peak() -> None:
    """Start VmHWM again from the current resident size (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def measure(prefill, step, rollback, short_step, sizes: list[int], steps: int, vocab: int) -> None:
    """Print one JSON line for each prompt length in ``sizes``: ``prefill(ids)`` from an empty cache, then
    ``steps`` one-token ``step(token)`` calls, each followed by ``rollback(length)`` and by one
    ``short_step(token)`` at :data:`SHORT` tokens of context (another cache of the same model): the two
    steps interleaved, so their ratio sees the same load."""
    import numpy as np

    rng = np.random.default_rng(0)
    for size in sizes:
        ids = rng.integers(1000, min(vocab, 30000), size + 1).tolist()
        before = memory_kb("VmRSS")
        reset_peak()
        started = time.perf_counter()
        prefill(ids[:size])
        seconds = time.perf_counter() - started
        peak = memory_kb("VmHWM")
        long, short, token = [], [], ids[size]
        for _ in range(steps):
            long.append(timed(step, token))
            rollback(size)
            short.append(timed(short_step, token))
        line = {
            "prompt_tokens": size,
            "prefill_s": seconds,
            "prefill_tok_s": size / seconds,
            "step_ms": 1000 * statistics.median(long),
            f"step_at_{SHORT}_ms": 1000 * statistics.median(short),
            f"step_over_step_at_{SHORT}": statistics.median(long) / statistics.median(short),
            "rss_before_gb": before / 2**20,
            "prefill_peak_gb": peak / 2**20,
            "prefill_peak_over_before_gb": (peak - before) / 2**20,
        }
        print(json.dumps(line), flush=True)


def timed(call, token: int) -> float:
    began = time.perf_counter()
    call(token)
    return time.perf_counter() - began


def short_context(vocab: int) -> list[int]:
    """The :data:`SHORT` prompt tokens of the interleaved short-context steps."""
    import numpy as np

    return np.random.default_rng(1).integers(1000, min(vocab, 30000), SHORT).tolist()


def run_marspec(
    model: str, threads: int, sizes: list[int], steps: int, chunk: int | None, kv_dtypes: list[str]
) -> None:
    import torch

    torch.set_num_threads(threads)
    from marspec import Decoder

    started = time.perf_counter()
    decoder = Decoder(model, None, device="cpu", threads=threads)
    lm = decoder.target
    if chunk is not None:
        lm.prefill_chunk = chunk or None
    print(
        json.dumps(
            {
                "engine": f"marspec {decoder.target_quant}",
                "model": model,
                "load_s": time.perf_counter() - started,
                "direct_forward": lm.direct is not None,
                "prefill_chunk": lm.prefill_chunk if lm.chunks_exactly() else None,
                "threads": threads,
            }
        ),
        flush=True,
    )

    def prefill(ids: list[int]) -> None:
        lm.reset()
        lm.forward(torch.tensor(ids), last_only=True)

    def step(token: int) -> None:
        lm.forward(torch.tensor([token]))

    from marspec.backends.hf import HFCausalLM

    for name in kv_dtypes or [None]:
        lm.kv_dtype = getattr(torch, name) if name else None
        # A cache of its own on the same model, holding what the long one holds.
        short = HFCausalLM(lm.model, lm.tokenizer, "short context", kv_dtype=lm.kv_dtype)
        short.forward(torch.tensor(short_context(lm.vocab_size)), last_only=True)
        print(json.dumps({"kv_dtype": str(lm.kv_dtype).removeprefix("torch.")}), flush=True)

        def short_step(token: int, short: HFCausalLM = short) -> None:
            short.forward(torch.tensor([token]))
            short.rollback(SHORT)

        measure(prefill, step, lm.rollback, short_step, sizes, steps, lm.vocab_size)


def run_llamacpp(path: str, threads: int, sizes: list[int], steps: int) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import llama_cpp as lc
    from llama_cpp_engine import Engine

    started = time.perf_counter()
    engine = Engine(path, threads, n_ctx=max(sizes) + 64)
    print(
        json.dumps(
            {
                "engine": "llama.cpp",
                "model": path,
                "load_s": time.perf_counter() - started,
                "llama_cpp_python": lc.__version__,
                "system_info": lc.llama_print_system_info().decode(),
                "threads": threads,
            }
        ),
        flush=True,
    )

    def prefill(ids: list[int]) -> None:
        engine.reset()
        engine.argmax(ids)

    short = Engine(path, threads, n_ctx=SHORT + 64, n_batch=8, model=engine.model)  # its own context
    short.argmax(short_context(engine.vocab))

    def short_step(token: int) -> None:
        short.argmax([token])
        short.cut(SHORT)

    measure(prefill, lambda token: engine.argmax([token]), engine.cut, short_step, sizes, steps, engine.vocab)


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("side", choices=("gguf", "marspec", "llamacpp"))
    parser.add_argument(
        "args", nargs="+", help="gguf: NAME FOLDER; marspec: a model name or GGUF; llamacpp: GGUF"
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 2048, 8192])
    parser.add_argument("--steps", type=int, default=5, help="one-token steps timed after each prompt")
    parser.add_argument("--chunk", type=int, help="marspec: tokens a prefill forward scores (0: all at once)")
    parser.add_argument("--cache", help="marspec's cache folder (MARSPEC_CACHE_DIR) for its side")
    kv_help = "marspec: its KV cache's dtypes, one after the other"
    parser.add_argument("--kv-dtypes", nargs="+", choices=("float32", "float16"), default=[], help=kv_help)
    add_threads(parser)
    args = parser.parse_args()
    if args.side == "gguf":
        sys.path.insert(0, str(Path(__file__).parent))
        from engines import gguf_of

        held = gguf_of(args.args[0], Path(args.args[1]))
        print(json.dumps({"gguf": str(held)}))
        return
    if args.cache:
        os.environ["MARSPEC_CACHE_DIR"] = args.cache
    if args.side == "marspec":
        run_marspec(args.args[0], args.threads, args.sizes, args.steps, args.chunk, args.kv_dtypes)
    else:
        run_llamacpp(args.args[0], args.threads, args.sizes, args.steps)


if __name__ == "__main__":
    main()
