"""Routes to a cheaper draft token, measured on the default int8 draft (issue 18, item 3).

    python benchmarks/draft_routes.py [--draft NAME] [--threads 2] [--compile]

Prints, for one-token draft forwards after a short prompt (median of 40 greedy steps):
- eager int8 ms/token, and the share of it spent in the int8 matrix products (torch profiler);
- the LM head cut to the first N token ids (BPE merge rank, so roughly the most frequent tokens), and
  how often the target's greedy tokens in the committed runs fall outside such a cut (each would be a
  draft the target must reject);
- int4 weight-only matrix products (torch's CPU int4pack kernel) against int8 dynamic ones, per shape;
- int8 products fused where they read the same input (q/k/v, gate/up) against apart;
- with ``--compile``: torch.compile (inductor, dynamic shapes) of the draft's forward, its compile time,
  its ms/token and whether its greedy tokens equal eager's (takes minutes);
- with ``--llama-cpp``: the same model's own GGUF (Q4_K_M) run by llama.cpp (llama-cpp-python, not a
  marspec dependency: it compiles for ~8-12 minutes), its ms/token and how many of its greedy tokens
  equal the int8 draft's. On a CPU with AMX, build it without AMX (a default native build crashed in
  its first forward on this project's Intel Xeon):
  ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON
  -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
  pip install llama-cpp-python==0.3.36``.
Run on a quiet machine: every figure is a timing.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import add_threads, script_parser  # this folder's shared helpers
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantLinear
from torch.profiler import ProfilerActivity, profile

from marspec.api import load_lm
from marspec.backends.hf import HFCausalLM
from marspec.backends.quantize import quantize_int8
from marspec.models.registry import DEFAULT_DRAFT

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' * 6
RUNS = Path(__file__).parents[1] / "docs" / "results"


def timed_steps(step: Callable[[int], int], token: int, n: int = 40) -> tuple[float, list[int]]:
    """Median ms of ``n`` greedy steps (``step``: a token -> the next), from ``token``, and the tokens."""
    times, tokens = [], []
    for _ in range(n):
        start = time.perf_counter()
        token = step(token)
        times.append(time.perf_counter() - start)
        tokens.append(token)
    return 1000 * statistics.median(times), tokens


def draft_steps(lm: HFCausalLM, prompt: torch.Tensor, n: int = 40) -> tuple[float, list[int]]:
    """Median ms of ``n`` greedy one-token forwards after ``prompt``, and the tokens drafted."""
    lm.reset()
    lm.forward(prompt, last_only=True)

    def step(token: int) -> int:
        return int(lm.forward(torch.tensor([token]), last_only=True)[-1].argmax())

    return timed_steps(step, int(prompt[-1]), n)


def linear_share(lm: HFCausalLM, prompt: torch.Tensor) -> float:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        draft_steps(lm, prompt, 20)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if e.key == "quantized::linear_dynamic") / total


def cut_head(head: DynamicQuantLinear, rows: int) -> DynamicQuantLinear:
    weight = head.weight().dequantize()[:rows]  # [rows, hidden]
    linear = torch.nn.Linear(weight.shape[1], rows, bias=False)
    linear.weight.data = weight
    linear.qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    return DynamicQuantLinear.from_float(linear)


def outside_cut(rows: int) -> dict[str, float]:
    """Share of strict's emitted tokens with id >= rows, per committed run that has them."""
    shares = {}
    for run in ("rivals-greedy-humaneval-30", "greedy-gsm8k-50"):
        path = RUNS / run / "records.jsonl"
        if not path.exists():
            continue
        ids = [
            token
            for line in path.read_text().splitlines()
            if (rec := json.loads(line))["method"] == "strict"
            for turn in rec["turns"]
            for token in turn.get("token_ids", [])
        ]
        if ids:
            shares[run] = sum(token >= rows for token in ids) / len(ids)
    return shares


def per_call_ms(fn: Callable[[], object], n: int = 200) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return 1000 * (time.perf_counter() - start) / n


def int4_against_int8(in_features: int, out_features: int, group: int = 32) -> tuple[float, float]:
    """ms per M=1 product of a random [out, in] weight: int8 dynamic, int4 weight-only (asymmetric,
    groups of ``group`` inputs)."""
    weight = torch.randn(out_features, in_features) * 0.02
    x = torch.randn(1, in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    linear.weight.data = weight
    linear.qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    int8 = DynamicQuantLinear.from_float(linear)
    grouped = weight.reshape(out_features, in_features // group, group)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    scale = (high - low).clamp(min=1e-6) / 15
    codes = ((grouped - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    zero = low + 8 * scale  # the kernel computes (code - 8) * scale + zero
    scales_and_zeros = torch.stack([scale[..., 0], zero[..., 0]], -1).transpose(0, 1).contiguous()
    return (
        per_call_ms(lambda: int8(x)),
        per_call_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)),
    )


def int8_product_ms(in_features: int, out_features: int) -> float:
    """ms per M=1 int8 dynamic product of a random [out, in] weight."""
    linear = torch.nn.Linear(in_features, out_features)
    linear.qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    int8 = DynamicQuantLinear.from_float(linear)
    x = torch.randn(1, in_features)
    return per_call_ms(lambda: int8(x))


def llama_cpp_steps(draft: str, threads: int, prompt: list[int], n: int = 40) -> tuple[float, list[int]]:
    """:func:`draft_steps` for the draft's GGUF in llama.cpp: median ms of ``n`` greedy one-token decodes
    after ``prompt``, and the tokens."""
    import tempfile

    import llama_cpp as lc
    import numpy as np

    from marspec.models.registry import get_spec

    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "draft.gguf"
        get_spec(draft).write_gguf(gguf)
        lc.llama_backend_init()
        model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
    params = lc.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 2048, 512, 512
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    batch = lc.llama_batch_init(512, 0, 1)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))

    def decode(tokens: list[int], base: int) -> int:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, base + i, 1, 0
            batch.seq_id[i][0] = 0
        batch.logits[len(tokens) - 1] = 1
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, len(tokens) - 1), shape=(vocab,))
        return int(logits.argmax())

    decode(prompt, 0)
    position = iter(range(len(prompt), len(prompt) + n))
    result = timed_steps(lambda token: decode([token], next(position)), prompt[-1], n)
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return result


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    add_threads(parser)
    parser.add_argument("--compile", action="store_true", help="also try torch.compile (minutes)")
    parser.add_argument("--llama-cpp", action="store_true", help="also time the GGUF in llama.cpp")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm, _ = load_lm(args.draft, torch.float32)
    quantize_int8(lm.model)
    prompt = lm.tokenizer(PROMPT, return_tensors="pt").input_ids[0]

    eager, eager_tokens = draft_steps(lm, prompt)
    share = linear_share(lm, prompt)
    print(f"eager int8 draft: {eager:.1f} ms/token; int8 matrix products {share:.0%} of it")
    head = lm.model.lm_head
    for rows in (65536, 32768):
        lm.model.lm_head = cut_head(head, rows)
        ms, _ = draft_steps(lm, prompt)
        outside = ", ".join(f"{run} {share:.1%}" for run, share in outside_cut(rows).items())
        print(f"head cut to the first {rows} ids: {ms:.1f} ms/token; strict's tokens beyond it: {outside}")
    lm.model.lm_head = head
    hidden, inner, vocab = lm.model.config.hidden_size, lm.model.config.intermediate_size, lm.vocab_size
    for shape in ((hidden, inner), (inner, hidden), (hidden, vocab)):
        int8_ms, int4_ms = int4_against_int8(*shape)
        print(f"[{shape[1]} x {shape[0]}] product, M=1: int8 dynamic {int8_ms:.3f} ms, int4 {int4_ms:.3f} ms")
    # Fusing products that read the same input: q, k and v (one 896 -> 1152), gate and up.
    config = lm.model.config
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    separate = 2 * int8_product_ms(hidden, kv) + int8_product_ms(hidden, hidden)
    fused = int8_product_ms(hidden, hidden + 2 * kv)
    print(f"q, k, v products: {separate:.3f} ms apart, {fused:.3f} ms fused (per layer)")
    separate, fused = 2 * int8_product_ms(hidden, inner), int8_product_ms(hidden, 2 * inner)
    print(f"gate, up products: {separate:.3f} ms apart, {fused:.3f} ms fused (per layer)")
    if args.llama_cpp:
        ms, tokens = llama_cpp_steps(args.draft, args.threads, prompt.tolist())
        same = sum(a == b for a, b in zip(tokens, eager_tokens, strict=True))
        print(f"llama.cpp (its GGUF): {ms:.1f} ms/token; {same} of {len(tokens)} greedy tokens as int8's")
    if args.compile:
        lm.model.forward = torch.compile(lm.model.forward, dynamic=True)
        start = time.perf_counter()
        draft_steps(lm, prompt, 3)
        compile_s = time.perf_counter() - start
        compiled, compiled_tokens = draft_steps(lm, prompt)
        same = "same" if compiled_tokens == eager_tokens else "different"
        print(f"torch.compile: {compile_s:.0f} s to compile, {compiled:.1f} ms/token, {same} tokens as eager")


if __name__ == "__main__":
    main()
