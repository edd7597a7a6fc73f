"""Run vLLM with and without marspec's rule on the same requests: tokens, time and accept counters.

Each engine runs in a child process of its own (vLLM expects one engine per process, and the plugin's
state is per process), so one configuration cannot leak into the next. The tests in ``tests_vllm/`` and
the command below use it::

    python -m marspec.integrations.vllm.compare --model TARGET_DIR [--draft DRAFT_DIR] --k 4

prints, for vLLM as shipped (no plugin loaded), the plugin at theta 1.0 and at theta 0.9: tokens per
second, how many outputs equal vLLM's own strict speculative output, and the plugin's counters.
Needs vLLM in the running interpreter's environment.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Question: A shop sells pens at 3 dollars each. Tom buys 7 pens and pays with a 50 dollar bill. "
    "How much change does he get?\nAnswer: Let's think step by step.",
    "Write a Python function that checks whether a string is a palindrome.\n",
    "List the planets of the solar system in order from the Sun, one per line, with one fact about each.\n",
)


@dataclass(frozen=True)
class EngineSpec:
    """One vLLM deployment: the models, the speculative settings and marspec's part in it."""

    model: str  # a Hugging Face checkpoint directory (vLLM cannot reach a hub here)
    draft: str | None = None  # a draft checkpoint directory; None: vLLM's n-gram drafting
    k: int = 4  # num_speculative_tokens
    # vLLM's speculative method: "auto" (a draft model if ``draft`` is set, else n-gram), "eagle3"
    # (``draft`` is an EAGLE-3 head for ``model``), or "none" (plain decoding, no speculation).
    method: str = "auto"
    marspec: dict[str, Any] | None = None  # additional_config["marspec"]; None: the plugin stays inert
    load_plugin: bool = True  # False: VLLM_PLUGINS="" so vLLM runs exactly as shipped
    memory_share: float = 0.3  # gpu_memory_utilization: on CPU, the share of RAM vLLM reserves
    # kv_cache_memory_bytes, in GiB: the KV cache's exact size, and then memory_share is not used. On CPU
    # the share's KV cache is the share minus what the engine process already holds, so a share near the
    # engine's own size gives a KV cache that comes and goes with a few hundred MB of process growth.
    kv_cache_gib: float | None = None
    max_model_len: int = 1024
    dtype: str = "float32"  # fp32: a many-token forward rounds like a one-token forward
    eager: bool = False  # enforce_eager: skip torch.compile (minutes of C++ builds per engine on CPU)


@dataclass(frozen=True)
class Request:
    """One prompt with its sampling settings; temperature 0 is greedy."""

    prompt: str
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # also return the target's top-N tokens at each generated position
    marspec: dict[str, Any] | None = (
        None  # extra_args["marspec"]: this request's own rule (None: the deployment's)
    )


@dataclass
class BatchResult:
    """What one ``LLM.generate`` call over a batch of requests gave."""

    tokens: list[list[int]]  # new token ids, one list per request, in request order
    seconds: float
    counters: dict[str, float] | None = None  # the plugin's counters for this batch alone; None if inert
    # Per request, per generated position: the target's top-N [token, logprob] pairs, best first (for
    # requests that asked for ``logprobs=N``; an empty list for the others).
    top: list[list[list[list[float]]]] | None = None
    counters_by_rule: dict[str, dict[str, int]] | None = None  # the counters per rule name; None if inert

    @property
    def new_tokens(self) -> int:
        return sum(map(len, self.tokens))


@dataclass
class EngineRun:
    """One engine's results, batch by batch."""

    spec: EngineSpec
    batches: list[BatchResult]


_RESULT = "MARSPEC_RESULT "  # marks the child's result line among vLLM's own output
_MODULE = "marspec.integrations.vllm.compare"  # not __name__, which is "__main__" under python -m


def run_engine(spec: EngineSpec, batches: list[list[Request]]) -> EngineRun:
    """Start ``spec``'s engine in a child process, run ``batches`` one after another, return the results."""
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in the child itself, so counters are readable
    if not spec.load_plugin:
        env["VLLM_PLUGINS"] = ""  # an allowlist matching no plugin
    job = json.dumps({"spec": asdict(spec), "batches": [[asdict(r) for r in batch] for batch in batches]})
    done = subprocess.run(
        [sys.executable, "-m", _MODULE, "--child"], input=job, capture_output=True, text=True, env=env
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith(_RESULT)), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"vLLM engine {spec} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    results = json.loads(line[len(_RESULT) :])
    return EngineRun(spec, [BatchResult(**r) for r in results])


def _child() -> None:
    """The child's side of :func:`run_engine`: the job on stdin, one result line on stdout."""
    job = json.load(sys.stdin)
    spec = EngineSpec(**job["spec"])
    batches = [[Request(**r) for r in batch] for batch in job["batches"]]
    from vllm import LLM, SamplingParams

    from marspec.integrations.vllm.plugin import read_counters, read_counters_by_rule, reset_counters

    extra = {"additional_config": {"marspec": spec.marspec}} if spec.marspec is not None else {}
    llm = LLM(
        model=spec.model,
        dtype=spec.dtype,
        max_model_len=spec.max_model_len,
        gpu_memory_utilization=spec.memory_share,
        kv_cache_memory_bytes=None if spec.kv_cache_gib is None else int(spec.kv_cache_gib * 2**30),
        distributed_executor_backend="uni",
        speculative_config=speculative_config(spec),
        seed=0,
        enforce_eager=spec.eager,
        **extra,
    )
    counting = spec.marspec is not None
    llm.generate(
        [DEFAULT_PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False
    )  # warm-up
    results = []
    for batch in batches:
        params = [
            SamplingParams(
                temperature=r.temperature,
                seed=r.seed,
                max_tokens=r.max_tokens,
                logprobs=r.logprobs,
                extra_args=None if r.marspec is None else {"marspec": r.marspec},
            )
            for r in batch
        ]
        if counting:
            reset_counters(llm)
        start = time.perf_counter()
        outputs = llm.generate([r.prompt for r in batch], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        counters = read_counters(llm) if counting else None
        by_rule = read_counters_by_rule(llm) if counting else None
        top = [_ranked(o.outputs[0].logprobs, r.logprobs) for o, r in zip(outputs, batch, strict=True)]
        results.append(asdict(BatchResult(tokens, seconds, counters, top, by_rule)))
    print(_RESULT + json.dumps(results), flush=True)


def _ranked(logprobs: Any, n: int | None) -> list[list[list[float]]]:
    """vLLM's per-position ``{token: Logprob}`` as the top ``n`` ``[token, logprob]`` pairs, best first
    (vLLM adds the chosen token to each position's dict whatever its rank: dropped unless in the top n)."""
    if not n or logprobs is None:
        return []
    return [
        [
            [token, entry.logprob]
            for token, entry in sorted(position.items(), key=lambda item: item[1].rank)
            if entry.rank is not None and entry.rank <= n
        ]
        for position in logprobs
    ]


def speculative_config(spec: EngineSpec) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for ``spec`` (None: plain decoding)."""
    if spec.method == "none":
        return None
    if spec.method == "eagle3":
        return {"method": "eagle3", "model": spec.draft, "num_speculative_tokens": spec.k}
    if spec.method != "auto":
        raise ValueError(f"EngineSpec.method={spec.method!r}: use 'auto', 'eagle3' or 'none'")
    if spec.draft:
        return {"model": spec.draft, "num_speculative_tokens": spec.k}
    return {"method": "ngram", "num_speculative_tokens": spec.k, "prompt_lookup_max": 4}


def compare(
    model: str,
    draft: str | None,
    k: int,
    max_tokens: int,
    memory_share: float,
    eager: bool,
    kv_cache_gib: float | None = None,
) -> None:
    """Print vLLM as shipped against the plugin at theta 1.0 and 0.9 on :data:`DEFAULT_PROMPTS` (greedy)."""
    batch = [Request(p, max_tokens=max_tokens) for p in DEFAULT_PROMPTS]
    common = {"memory_share": memory_share, "kv_cache_gib": kv_cache_gib, "eager": eager}
    configs = {
        "vLLM, no plugin": EngineSpec(model, draft, k, load_plugin=False, **common),
        "marspec theta=1.0": EngineSpec(model, draft, k, {"rule": "mars", "theta": 1.0}, **common),
        "marspec theta=0.9": EngineSpec(
            model, draft, k, {"rule": "mars", "theta": 0.9, "margin": "logit_ratio"}, **common
        ),
    }
    runs = {name: run_engine(spec, [batch]).batches[0] for name, spec in configs.items()}
    base = runs["vLLM, no plugin"].tokens
    print(f"{'configuration':20s} {'tok/s':>7s}  same as vLLM  mean accepted  relaxed/accepted")
    for name, r in runs.items():
        same = sum(a == b for a, b in zip(r.tokens, base, strict=True))
        c = r.counters
        accepted = f"{c['mean_accepted']:13.2f}" if c else f"{'—':>13s}"
        relaxed = f"{c['accepted_relaxed']}/{c['accepted_exact'] + c['accepted_relaxed']}" if c else "—"
        print(f"{name:20s} {r.new_tokens / r.seconds:7.2f}  {same}/{len(base):<10d}  {accepted}  {relaxed}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="target checkpoint directory")
    parser.add_argument("--draft", help="draft checkpoint directory (default: n-gram drafting)")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--memory-share", type=float, default=0.3, help="share of RAM vLLM reserves on CPU")
    parser.add_argument(
        "--kv-cache-gib", type=float, help="KV cache size in GiB (replaces --memory-share's reservation)"
    )
    parser.add_argument(
        "--eager", action="store_true", help="skip torch.compile (faster start, slower steps)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child()
    elif not args.model:
        parser.error("--model is required (a Hugging Face checkpoint directory)")
    else:
        compare(
            args.model, args.draft, args.k, args.max_tokens, args.memory_share, args.eager, args.kv_cache_gib
        )


if __name__ == "__main__":
    main()
