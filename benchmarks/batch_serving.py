"""`marspec serve` under 1, 2, 4 and 8 concurrent clients: what continuous batching buys (issue 69, item 4).

Starts one server on the default pair as a CPU user gets it (the int8 engine, a 4-bit draft) with
--max-batch at the most clients measured, then for each client count runs that many clients at once,
each streaming the demo's prompts (marspec.demo.DEMO_PROMPTS) one after another with --max-tokens new
tokens (the server's default rule, strict: lossless, unless --rule). Reports per level: aggregate
completion tok/s (all tokens over the level's wall time), each request's own tok/s (its tokens over its
time from first to last token), and time to first token; and checks every answer against that prompt's
answer with one client (greedy decoding: any difference would be a batching bug). With --llama-python,
then runs llama.cpp on the same machine in the same run, decoding the same prompts as 1, 2, 4 and 8
sequences of one batch (benchmarks/llama_cpp_batched.py, in that Python's environment, on the target's
packaged GGUF), and puts its JSON beside marspec's. Writes JSON.

    python benchmarks/batch_serving.py --clients 1 2 4 8 --max-tokens 128 \\
        --out docs/results/batch-serving.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from _common import add_threads, git_commit, machine, script_parser, write_json  # this folder's helpers

from marspec.demo import DEMO_PROMPTS
from marspec.serve.process import launch

CHAT = "/v1/chat/completions"


def stream_one(url: str, prompt: str, max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat request: its text, token count (the server's usage) and timings."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    start = time.perf_counter()
    first = last = None
    text, tokens = "", 0
    with httpx.stream("POST", f"{url}{CHAT}", json=body, timeout=1800) as res:
        res.raise_for_status()
        for line in res.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text += piece
    assert first is not None and last is not None, "no text streamed"
    return {
        "text": text,
        "tokens": tokens,
        "ttft_s": first - start,
        "seconds": last - start,
        "tok_s": tokens / (last - first) if last > first else None,
    }


def level(url: str, clients: int, max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    """``clients`` clients at once, each streaming every demo prompt (client i starts at prompt i)."""
    results: list[list[dict[str, Any]]] = [[] for _ in range(clients)]

    def client(i: int) -> None:
        for j in range(len(DEMO_PROMPTS)):
            _, prompt = DEMO_PROMPTS[(i + j) % len(DEMO_PROMPTS)]
            results[i].append(
                {"prompt": (i + j) % len(DEMO_PROMPTS), **stream_one(url, prompt, max_tokens, extra)}
            )

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    requests = [r for per_client in results for r in per_client]
    tokens = sum(r["tokens"] for r in requests)
    rates = [r["tok_s"] for r in requests if r["tok_s"]]
    return {
        "clients": clients,
        "requests": requests,
        "wall_s": wall,
        "completion_tokens": tokens,
        "aggregate_tok_s": tokens / wall,
        "per_request_tok_s_median": statistics.median(rates),
        "ttft_s_median": statistics.median(r["ttft_s"] for r in requests),
        "ttft_s_max": max(r["ttft_s"] for r in requests),
    }


def llama_cpp_batched(args: argparse.Namespace) -> dict[str, Any]:
    """llama.cpp's batched greedy decoding of the same prompts, run in ``--llama-python``'s environment."""
    from engines import gguf_of  # this folder's: the target's packaged GGUF as a file

    from marspec.models import DEFAULT_TARGET

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "llama.json"
        script = Path(__file__).with_name("llama_cpp_batched.py")
        command = [args.llama_python, str(script), "--model", str(gguf_of(DEFAULT_TARGET, Path(scratch)))]
        command += ["--sequences", ",".join(map(str, args.clients)), "--max-new-tokens", str(args.max_tokens)]
        command += ["--threads", str(args.threads), "--out", str(out)]
        subprocess.run(command, check=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rule", default=None, help="the requests' rule (default: the server's, strict)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python (omit: no llama.cpp run)")
    add_threads(parser)
    args = parser.parse_args()
    extra = {"marspec": {"rule": args.rule}} if args.rule else {}
    flags = ["--port", "0", "--threads", str(args.threads), "--max-batch", str(max(args.clients))]
    flags += [
        "--max-queue",
        str(4 * max(args.clients)),
        "--request-timeout",
        "0",
        "--served-model-name",
        "default",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        server = launch(flags, Path(tmp) / "server.log", timeout=900)
        try:
            stream_one(server.url, "Hello", 8, extra)  # warm-up: first forwards, allocations
            levels = []
            for clients in args.clients:
                levels.append(level(server.url, clients, args.max_tokens, extra))
                print(
                    f"{clients} clients: {levels[-1]['aggregate_tok_s']:.2f} tok/s in all, "
                    f"{levels[-1]['per_request_tok_s_median']:.2f} per request, "
                    f"TTFT {levels[-1]['ttft_s_median']:.2f} s",
                    flush=True,
                )
        finally:
            server.stop()
    result = summary(args, flags, levels)
    write_json(args.out, result)  # marspec's levels are kept whatever happens to llama.cpp's run
    if args.llama_python:
        result["llama_cpp_batched"] = llama_cpp_batched(args)
        write_json(args.out, result)


def summary(args: argparse.Namespace, flags: list[str], levels: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's JSON: the levels with their ratios to one client, and the answers' check."""
    solo = {r["prompt"]: r["text"] for r in levels[0]["requests"]}
    differing = sum(
        r["text"] != solo[r["prompt"]] for lv in levels for r in lv["requests"] if r["prompt"] in solo
    )
    base = levels[0]["aggregate_tok_s"]
    for lv in levels:
        lv["aggregate_vs_one_client"] = lv["aggregate_tok_s"] / base
        lv["per_request_vs_one_client"] = (
            lv["per_request_tok_s_median"] / levels[0]["per_request_tok_s_median"]
        )
    return {
        "command": "python benchmarks/batch_serving.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if v is not None
        ),
        "server_flags": flags,
        "commit": git_commit(),
        "machine": machine(),
        "rule": args.rule or "strict (the server's default)",
        "answers_differing_from_one_client": differing,
        "levels": levels,
    }


if __name__ == "__main__":
    main()
