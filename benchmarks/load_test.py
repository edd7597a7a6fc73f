"""A bounded load test of `marspec serve`: N concurrent clients for a fixed time, then a verdict.

Starts a server (or uses --url), records each prompt's greedy output once, then runs --clients concurrent
clients for --duration seconds, each sending requests back to back (chat and text completions, streamed
and not). Every answer is checked: a 200 must be well formed and carry exactly the recorded text (greedy
decoding is deterministic, so any difference is corruption, e.g. state leaking between generations); a
429 must carry Retry-After, which the client then honours. Reports throughput, p50/p95 latency, the
number of 429s, 5xx responses and lost (no complete answer) or corrupted responses; writes them as JSON
and exits 1 unless there were no 5xx, lost, corrupted or otherwise unexpected responses. It stops by
itself: clients start no request after --duration and each request has a client-side time limit.

    python benchmarks/load_test.py --target smollm2-135m-instruct --draft ngram --threads 1 \\
        --clients 6 --duration 20 --out runs/loadtest.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _common import add_threads, script_parser, write_json  # this folder's shared helpers

from marspec.serve.process import ServerProcess, launch

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
# (endpoint, request fields): short outputs on purpose; a load test measures the server, not the model.
PROMPTS: list[tuple[str, dict[str, Any]]] = [
    (TEXT, {"prompt": "def fib(n):"}),
    (CHAT, {"messages": [{"role": "user", "content": "Repeat this list: apple, banana, cherry."}]}),
    (CHAT, {"messages": [{"role": "user", "content": "What is the capital of France? One sentence."}]}),
    (TEXT, {"prompt": "The quick brown fox", "marspec": {"rule": "strict", "k": 3}}),
]


@dataclass
class Result:
    """One request's fate."""

    kind: str  # ok | rate_limited | server_error | lost | corrupted | unexpected
    latency_s: float
    status: int | None = None
    tokens: int = 0
    detail: str = ""


@dataclass
class Report:
    clients: int
    duration_s: float
    requests: int
    ok: int
    throughput_rps: float
    tokens_per_s: float
    latency_p50_s: float | None
    latency_p95_s: float | None
    rate_limited_429: int
    server_errors_5xx: int
    lost: int
    corrupted: int
    unexpected: int
    server_exit_status: int | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (
            self.ok > 0
            and self.server_errors_5xx == self.lost == self.corrupted == self.unexpected == 0
            and self.server_exit_status in (None, 0)
        )


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100])."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def request_body(model: str, fields: dict[str, Any], max_tokens: int, stream: bool) -> dict[str, Any]:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, **fields}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def answer_text(path: str, answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if path == CHAT else choice["text"]


def check_answer(path: str, answer: dict[str, Any], expected: str) -> str:
    """What is wrong with a non-streamed answer ('' if nothing)."""
    choice = answer["choices"][0]
    if choice["finish_reason"] not in ("stop", "length"):
        return f"finish_reason {choice['finish_reason']!r}"
    if answer_text(path, answer) != expected:
        return f"text {answer_text(path, answer)!r} != {expected!r}"
    if answer["usage"]["completion_tokens"] != answer["marspec"]["new_tokens"]:
        return "usage disagrees with the marspec statistics"
    return ""


def check_stream(path: str, lines: list[str], expected: str) -> tuple[str, int]:
    """What is wrong with a stream's lines ('' if nothing), and its completion tokens."""
    if not lines or lines[-1] != "data: [DONE]":
        return "the stream did not end with data: [DONE]", 0
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    pieces = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join((p["delta"].get("content") or "") if path == CHAT else p["text"] for p in pieces)
    finishes = [p["finish_reason"] for p in pieces if p["finish_reason"]]
    if finishes not in (["stop"], ["length"]):
        return f"finish reasons {finishes}", 0
    if text != expected:
        return f"text {text!r} != {expected!r}", 0
    usage = chunks[-1].get("usage")
    if not usage or chunks[-1]["choices"]:
        return "no usage chunk at the end", 0
    return "", usage["completion_tokens"]


async def send(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], expected: str, timeout: float
) -> Result:
    start = time.monotonic()
    lines: list[str] | None = None
    raw = b""
    try:
        async with asyncio.timeout(timeout), http.stream("POST", path, json=body) as res:
            if res.status_code == 200 and body.get("stream"):
                lines = [line async for line in res.aiter_lines() if line]
            else:
                raw = await res.aread()
    except (httpx.HTTPError, TimeoutError) as exc:  # no complete answer
        return Result("lost", time.monotonic() - start, detail=f"{type(exc).__name__}: {exc}")
    elapsed = time.monotonic() - start
    status = res.status_code
    if status == 429:
        retry = res.headers.get("Retry-After", "")
        if not retry.isdigit():
            return Result("unexpected", elapsed, status, detail="429 without a Retry-After")
        return Result("rate_limited", elapsed, status, detail=retry)
    if status != 200:
        kind = "server_error" if status >= 500 else "unexpected"
        return Result(kind, elapsed, status, detail=raw.decode(errors="replace")[:300])
    failed = next((line for line in lines or [] if line.startswith('data: {"error"')), None)
    if failed is not None:  # the stream started, then the server gave up on it
        return Result("server_error", elapsed, status, detail=failed[:300])
    try:
        if lines is not None:
            problem, tokens = check_stream(path, lines, expected)
        else:
            answer = json.loads(raw)
            problem, tokens = check_answer(path, answer, expected), answer["usage"]["completion_tokens"]
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        problem, tokens = f"malformed answer: {exc!r}", 0
    if problem:
        return Result("corrupted", elapsed, status, detail=problem)
    return Result("ok", elapsed, status, tokens=tokens)


async def client_loop(
    cid: int,
    http: httpx.AsyncClient,
    model: str,
    expected: list[str],
    args: argparse.Namespace,
    stop_at: float,
    results: list[Result],
) -> None:
    i = cid
    while time.monotonic() < stop_at:
        path, fields = PROMPTS[i % len(PROMPTS)]
        body = request_body(model, fields, args.max_tokens, stream=(i // len(PROMPTS) + cid) % 2 == 1)
        result = await send(http, path, body, expected[i % len(PROMPTS)], args.request_timeout)
        results.append(result)
        if result.kind == "rate_limited":  # back off as told, but never past the end of the run
            await asyncio.sleep(min(float(result.detail), max(0.0, stop_at - time.monotonic())))
        i += 1


async def run_load(url: str, model: str, args: argparse.Namespace) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=args.clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as http:
        expected = []
        for path, fields in PROMPTS:  # each prompt's greedy output, alone on the server
            res = await http.post(path, json=request_body(model, fields, args.max_tokens, stream=False))
            res.raise_for_status()
            expected.append(answer_text(path, res.json()))
        results: list[Result] = []
        start = time.monotonic()
        stop_at = start + args.duration
        loops = [client_loop(c, http, model, expected, args, stop_at, results) for c in range(args.clients)]
        await asyncio.gather(*loops)
        return results, time.monotonic() - start


def summarize(results: list[Result], elapsed: float, args: argparse.Namespace) -> Report:
    kinds = Counter(r.kind for r in results)
    ok = [r for r in results if r.kind == "ok"]
    latencies = [r.latency_s for r in ok]
    return Report(
        clients=args.clients,
        duration_s=round(elapsed, 3),
        requests=len(results),
        ok=len(ok),
        throughput_rps=round(len(ok) / elapsed, 3),
        tokens_per_s=round(sum(r.tokens for r in ok) / elapsed, 2),
        latency_p50_s=_round(percentile(latencies, 50)),
        latency_p95_s=_round(percentile(latencies, 95)),
        rate_limited_429=kinds["rate_limited"],
        server_errors_5xx=kinds["server_error"],
        lost=kinds["lost"],
        corrupted=kinds["corrupted"],
        unexpected=kinds["unexpected"],
        problems=[
            f"{r.kind} {r.status}: {r.detail}" for r in results if r.kind not in ("ok", "rate_limited")
        ][:20],
    )


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--url", help="Use this running server instead of starting one.")
    parser.add_argument("--model", help="The served model name (default: --target).")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default="ngram")
    add_threads(parser, default=1)
    parser.add_argument("--max-queue", type=int, default=2, help="The started server's --max-queue.")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--duration", type=float, default=20.0, help="Seconds during which requests start.")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--request-timeout", type=float, default=60.0, help="Client-side limit per request.")
    parser.add_argument("--out", type=Path, default=Path("runs/loadtest.json"))
    args = parser.parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or args.max_tokens < 1:
        parser.error("--clients, --duration and --max-tokens must be positive")

    server: ServerProcess | None = None
    url = args.url
    if url is None:
        flags = ["--target", args.target, "--draft", args.draft, "--threads", str(args.threads)]
        flags += ["--port", "0", "--max-queue", str(args.max_queue), "--log-level", "warning"]
        log_path = Path(tempfile.mkdtemp(prefix="marspec-loadtest-")) / "server.log"
        print(f"starting marspec serve (log: {log_path})", file=sys.stderr)
        server = launch(flags, log_path)
        url = server.url
    try:
        results, elapsed = asyncio.run(run_load(url, args.model or args.target, args))
    finally:
        status = server.stop() if server is not None else None
    report = summarize(results, elapsed, args)
    report.server_exit_status = status
    if status not in (None, 0):
        report.problems.append(f"the server exited with status {status} after SIGTERM")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, {**asdict(report), "passed": report.passed})
    p50, p95 = report.latency_p50_s, report.latency_p95_s
    print(
        f"{report.clients} clients, {report.duration_s:.1f} s: {report.requests} requests, {report.ok} ok, "
        f"{report.throughput_rps:.2f} req/s, {report.tokens_per_s:.1f} tok/s, "
        f"latency p50 {p50 or 0:.3f} s p95 {p95 or 0:.3f} s, {report.rate_limited_429} x 429, "
        f"{report.server_errors_5xx} x 5xx, {report.lost} lost, {report.corrupted} corrupted, "
        f"{report.unexpected} unexpected -> {'PASS' if report.passed else 'FAIL'} ({args.out})"
    )
    for problem in report.problems:
        print(f"  {problem}", file=sys.stderr)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
