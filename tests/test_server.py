"""`marspec serve` for real: server subprocesses on loopback running SmolLM2-135M with n-gram drafting, talked
to with the official openai client and httpx.

One server (`server`, --max-queue 1, one request at a time) takes the API, error and load-behaviour
tests; a second one (`short_server`, short time limit and shutdown grace) takes the time-limit tests and
is then stopped with SIGTERM while requests are in flight; a third (`batch_server`, --max-batch 2) decodes
requests together and is checked against its own answers to each request alone.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from eagle3_heads import last_layer_ids, write_head
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from marspec.api import Decoder, GenerationOptions
from marspec.backends.fixed_batch import HIDDEN_STATES_REFUSAL
from marspec.cli import app
from marspec.defaults import DEFAULT_K, MAX_K
from marspec.selftest.tiny import save_tiny_model, tiny_model
from marspec.serve.engine import Delta, Engine, Event, Failed, Finished, Job
from marspec.serve.errors import ApiError
from marspec.serve.process import ServerProcess, launch
from marspec.serve.schemas import CompletionRequest, parse_request
from marspec.serve.settings import ServerSettings

MODEL = "smollm2-135m-instruct"
BASE_FLAGS = ["--target", MODEL, "--draft", "ngram", "--threads", "1", "--port", "0"]
# Prompts where n-gram drafts hit SmolLM2's runner-up at near-ties, so MARS relaxes (found by experiment).
LIST_PROMPT = "Repeat this list: apple, banana, cherry, apple, banana, cherry."
EXPLAIN_PROMPT = "Explain what a dictionary is in Python, briefly."  # MARS relaxes early on
RELAXING_PROMPT = "Explain what a list is in Python, briefly."  # a close call early on
# A prompt SmolLM2 continues for hundreds of tokens: a request that is still running when we act on it.
LONG_BODY = {
    "model": MODEL,
    "prompt": "Count from 1 to 500: 1, 2, 3,",
    "max_tokens": 400,
    "marspec": {"rule": "plain"},
}
SHORT_BODY = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 12}


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # One request at a time, so that the queue tests below know which request runs and which waits.
    flags = [*BASE_FLAGS, "--max-queue", "1", "--max-batch", "1"]
    proc = launch(flags, tmp_path_factory.mktemp("server") / "server.log")
    yield proc
    status = proc.stop()
    assert status == 0, proc.log()
    assert "Traceback" not in proc.log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(url: str, name: str, **labels: str) -> float:
    return metric_samples(url).get((name, tuple(sorted(labels.items()))), 0.0)


def wait_until(condition, timeout: float = 120.0) -> None:
    """Poll ``condition`` until it holds; the deadline is generous so that a busy machine only makes
    tests slower, never failed."""
    deadline = time.monotonic() + timeout
    while not condition():
        # timing-guard: a deadline of minutes for conditions reached in seconds; a busy machine waits longer
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def accepts_connections(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=5)
    except httpx.ConnectError:
        return False
    except httpx.HTTPError:  # listening, but slow to answer
        return True
    return True


def post_head(host: str, length: int) -> bytes:
    """The head of a JSON POST to the completions route declaring ``length`` bytes of body, for the tests
    that write a request to a socket of their own."""
    return (
        f"POST {TEXT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


# ---------------------------------------------------------------------------------------------------------
# Start-up errors: one line and exit status 2, like every other command

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--rule", "mars", "--theta", "1.5"], "theta"),
        (["--theta", "0.9"], "no rule is named"),
        (["--k", "0"], "k (draft length)"),
        (["--rule", "fast"], "unknown rule"),
        (["--max-tokens", "0"], "max_new_tokens"),
        (["--max-queue", "-1"], "--max-queue"),
        (["--max-batch", "0"], "--max-batch"),
        (["--request-timeout", "-1"], "--request-timeout"),
        (["--shutdown-grace", "-1"], "--shutdown-grace"),
        (["--max-request-mb", "0"], "--max-request-mb"),
        (["--port", "70000"], "--port"),
        (["--draft", "none"], "needs a drafter"),
        (["--log-level", "loud"], "--log-level"),
        (["--target", "no-such-model", "--port", "0"], "unknown model"),
    ],
)
def test_startup_errors_are_one_line_and_exit_2(args: list[str], needle: str) -> None:
    result = runner.invoke(app, ["serve", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], result.output


def test_a_batch_drafted_by_an_eagle3_head_on_the_fixed_path_is_refused_before_loading(
    tmp_path: Path,
) -> None:
    target_dir = save_tiny_model(tmp_path / "target", tiny_model(seed=0, layers=4))
    config = json.loads((target_dir / "config.json").read_text())
    head = write_head(tmp_path / "head", config, target_dir, {1: 2}, layers=last_layer_ids(4))
    flags = ["--target", str(target_dir), "--draft", str(head), "--graphs", "on", "--port", "0"]
    result = runner.invoke(app, ["serve", *flags, "--max-batch", "2"])
    assert result.exit_code == 2, result.output
    assert result.output == f"error: --max-batch 2: {HIDDEN_STATES_REFUSAL}\n"


def test_startup_on_a_taken_port_is_one_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(app, ["serve", "--target", MODEL, "--draft", "ngram", "--port", str(port)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: cannot listen on 127.0.0.1:") and result.output.count("\n") == 1


# ---------------------------------------------------------------------------------------------------------
# The API with the openai client


def test_chat_completion(client: openai.OpenAI) -> None:
    res = client.chat.completions.create(model=MODEL, messages=chat(LIST_PROMPT), max_tokens=24)
    assert res.object == "chat.completion" and res.model == MODEL
    choice = res.choices[0]
    assert choice.message.role == "assistant" and "apple" in choice.message.content.lower()
    assert choice.finish_reason in ("stop", "length")
    stats = res.model_extra["marspec"]
    assert res.usage.completion_tokens == stats["new_tokens"] > 0
    assert res.usage.prompt_tokens == stats["prompt_tokens"] > 0
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens
    assert (
        stats["rule"] == "strict" and stats["accepted_relaxed"] == 0 and stats["k"] == DEFAULT_K
    )  # defaults
    assert stats["tau"] >= 1.0 and stats["timed_out"] is False
    for key in ("drafted", "accepted_exact", "accepted_relaxed", "rejected", "relaxed_positions"):
        assert key in stats


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": chat(EXPLAIN_PROMPT), "max_tokens": 20}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same text, delivered in pieces
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finals[0].model_extra["marspec"]["new_tokens"] == whole.usage.completion_tokens
    usage = chunks[-1].usage  # the usage chunk comes last
    assert chunks[-1].choices == [] and usage is not None
    # The same counts; the stream found the whole answer's prompt cached (all of it but the last token).
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == whole.usage.model_dump(
        exclude={"prompt_tokens_details"}
    )
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert all(c.usage is None for c in chunks[:-1])


def test_text_completion_stream_and_not(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=16)
    assert whole.object == "text_completion" and whole.choices[0].text.strip()
    assert whole.usage.prompt_tokens == 5  # raw text, no chat template around it
    chunks = list(client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=16, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert chunks[-1].model_extra["marspec"]["new_tokens"] == 16


def test_mars_relaxes_and_strict_equals_plain(client: openai.OpenAI) -> None:
    def run(rule: str, **controls: Any):
        res = client.chat.completions.create(
            model=MODEL,
            messages=chat(EXPLAIN_PROMPT),
            max_tokens=40,
            extra_body={"marspec": {"rule": rule, **controls}},
        )
        return res.choices[0].message.content, res.model_extra["marspec"]

    plain_text, plain = run("plain")
    strict_text, strict = run("strict", k=4)
    mars_text, mars = run("mars", theta=0.9, margin="logit_ratio", k=4)  # the paper's setting
    assert plain["drafted"] == 0 and plain["tau"] == 1.0
    assert strict_text == plain_text and strict["accepted_relaxed"] == 0 and strict["drafted"] > 0
    assert mars["rule"] == "mars" and mars["theta"] == 0.9 and mars["k"] == 4
    assert mars["accepted_relaxed"] > 0 and len(mars["relaxed_positions"]) > 0
    assert mars_text != strict_text  # a relaxed accept took the target's runner-up


def test_a_request_that_names_no_rule_decodes_exactly_like_plain(client: openai.OpenAI) -> None:
    def run(extra: dict[str, Any]):
        res = client.chat.completions.create(
            model=MODEL, messages=chat(EXPLAIN_PROMPT), max_tokens=40, extra_body=extra
        )
        return res.choices[0].message.content, res.model_extra["marspec"]

    default_text, default = run({})
    plain_text, _ = run({"marspec": {"rule": "plain"}})
    mars_text, _ = run({"marspec": {"rule": "mars", "theta": 0.9, "margin": "logit_ratio"}})
    assert default["rule"] == "strict" and default["drafted"] > 0 and default["accepted_relaxed"] == 0
    assert default_text == plain_text != mars_text  # the prompt is one where MARS relaxes


def test_a_chats_next_turn_reuses_the_cache_and_answers_as_if_fresh(client: openai.OpenAI) -> None:
    def ask(messages: list[dict[str, str]]):
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)

    first = ask(chat(LIST_PROMPT))
    follow_up = [
        *chat(LIST_PROMPT),
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Now say it in reverse order."},
    ]
    reused = ask(follow_up)
    # The server keeps the last conversation's cache: at least the whole first prompt but its last token.
    assert reused.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert reused.usage.prompt_tokens_details.cached_tokens < reused.usage.prompt_tokens
    client.completions.create(model=MODEL, prompt="Count to three:", max_tokens=4)  # replaces the cache
    fresh = ask(follow_up)
    assert fresh.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - 1
    assert fresh.choices[0].message.content == reused.choices[0].message.content


def test_models_and_health(client: openai.OpenAI, http: httpx.Client) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    card = client.models.retrieve(MODEL).model_extra
    assert card["context_length"] == 8192
    # The defaults a request without a "marspec" field gets, greedy and sampling, stated by the server.
    assert card["marspec"] == {"rule": "strict", "lossless": True, "k": DEFAULT_K}
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_metrics(client: openai.OpenAI, server: ServerProcess) -> None:
    before = metric(server.url, "marspec_accepted_draft_tokens_total", kind="relaxed")
    paper = {"marspec": {"rule": "mars", "theta": 0.9, "margin": "logit_ratio"}}
    client.chat.completions.create(
        model=MODEL, messages=chat(RELAXING_PROMPT), max_tokens=24, extra_body=paper
    )
    samples = metric_samples(server.url)
    assert samples[("marspec_accepted_draft_tokens_total", (("kind", "relaxed"),))] > before
    chat_ok = (("endpoint", "/v1/chat/completions"), ("status", "200"))
    assert samples[("marspec_requests_total", chat_ok)] >= 1
    for name in (
        "marspec_prompt_tokens_total",
        "marspec_completion_tokens_total",
        "marspec_target_forwards_total",
        "marspec_draft_tokens_total",
        "marspec_tau_count",
        "marspec_time_to_first_token_seconds_count",
        "marspec_queue_wait_seconds_count",
    ):
        assert samples[(name, ())] > 0, name
    assert samples[("marspec_request_latency_seconds_count", (("endpoint", "/v1/chat/completions"),))] >= 1
    assert samples[("marspec_generations_total", (("outcome", "completed"),))] >= 1
    assert samples[("marspec_queue_depth", ())] == 0 and samples[("marspec_busy", ())] == 0


# ---------------------------------------------------------------------------------------------------------
# Bad input: OpenAI's error format, the right status, never a 500

TOO_LONG = "hello " * 9000  # > 8192 tokens
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": chat("Hi"), "max_tokens": 4, **fields}


def raw(**fields: Any) -> bytes:
    """A body as raw bytes with what json.dumps would escape or refuse: ESCAPE in a string becomes the
    JSON escape backslash-u-D800, and a lone surrogate character its UTF-8-like bytes ED A0 80."""
    text = json.dumps({"model": MODEL, "max_tokens": 4, **fields}, ensure_ascii=False)
    return text.replace(ESCAPE, "\\ud800").encode("utf-8", "surrogatepass")


ESCAPE = "<lone surrogate escape>"


DEEP_CLOSED = b"[" * 100_000 + b"]" * 100_000
BAD_INPUTS = [
    # (id, path, json body or raw bytes, status, param, code, words in the message)
    ("malformed-json", CHAT, b'{"model": "x", ', 400, None, "invalid_json", "not valid JSON"),
    ("not-an-object", CHAT, b"[1, 2]", 400, None, "invalid_body", "JSON object"),
    ("missing-messages", CHAT, {"model": MODEL}, 400, "messages", "missing_parameter", "messages"),
    ("missing-model", CHAT, {"messages": chat("Hi")}, 400, "model", "missing_parameter", "model"),
    ("missing-prompt", TEXT, {"model": MODEL}, 400, "prompt", "missing_parameter", "prompt"),
    ("unknown-model", CHAT, body(model="gpt-9"), 404, "model", "model_not_found", "gpt-9"),
    ("unknown-model-text", TEXT, {"model": "gpt-9", "prompt": "x"}, 404, "model", "model_not_found", "gpt-9"),
    ("theta-high", CHAT, body(marspec={"rule": "mars", "theta": 1.5}), 400, "marspec.theta", None, "theta"),
    (
        "theta-negative",
        CHAT,
        body(marspec={"rule": "mars", "theta": -0.1}),
        400,
        "marspec.theta",
        None,
        "[0, 1]",
    ),
    ("theta-type", CHAT, body(marspec={"theta": "high"}), 400, "marspec.theta", "invalid_type", "number"),
    ("k-zero", CHAT, body(marspec={"k": 0}), 400, "marspec.k", None, "k (draft length)"),
    ("rule-unknown", CHAT, body(marspec={"rule": "fast"}), 400, "marspec.rule", None, "unknown rule"),
    (
        "rival-parameter",
        CHAT,
        body(marspec={"rule": "topk", "theta": 2.5}),
        400,
        "marspec.theta",
        None,
        "invalid for rule 'topk'",
    ),
    (
        "fly-parameter",
        CHAT,
        body(marspec={"rule": "fly", "theta": -0.5}),
        400,
        "marspec.theta",
        None,
        "invalid for rule 'fly'",
    ),
    (
        "margin-unknown",
        TEXT,
        {**SHORT_BODY, "marspec": {"rule": "mars", "margin": "vibes"}},
        400,
        "marspec.margin",
        None,
        "margin",
    ),
    (
        "marspec-extra",
        CHAT,
        body(marspec={"speed": 2}),
        400,
        "marspec.speed",
        "unsupported_parameter",
        "speed",
    ),
    ("timeout-above-limit", CHAT, body(marspec={"timeout": 1e6}), 400, "marspec.timeout", None, "timeout"),
    ("temperature-negative", CHAT, body(temperature=-1), 400, "temperature", None, "temperature"),
    ("temperature-high", CHAT, body(temperature=3), 400, "temperature", None, "[0, 2]"),
    ("max-tokens-zero", CHAT, body(max_tokens=0), 400, "max_tokens", None, ">= 1"),
    ("max-tokens-context", TEXT, {**SHORT_BODY, "max_tokens": 10**6}, 400, "max_tokens", None, "context"),
    (
        "max-completion-zero",
        CHAT,
        {**body(), "max_tokens": None, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        None,
        ">= 1",
    ),
    (
        "max-tokens-disagree",
        CHAT,
        body(max_completion_tokens=8),
        400,
        "max_completion_tokens",
        None,
        "disagree",
    ),
    ("max-tokens-type", CHAT, body(max_tokens="ten"), 400, "max_tokens", "invalid_type", "integer"),
    ("seed-range", CHAT, body(seed=2**64), 400, "seed", None, "64-bit"),
    ("n", CHAT, body(n=9), 400, "n", None, "[1, 8]"),
    ("top-p", CHAT, body(top_p=0.5), 400, "top_p", "unsupported_parameter", "not supported"),
    ("top-logprobs", CHAT, body(top_logprobs=2), 400, "top_logprobs", None, "logprobs=true"),
    ("tools", CHAT, body(tools=[{"type": "function"}]), 400, "tools", "unsupported_parameter", "tools"),
    ("unknown-field", CHAT, body(frobnicate=1), 400, "frobnicate", "unsupported_parameter", "frobnicate"),
    (
        "stream-options",
        CHAT,
        body(stream_options={"include_usage": True}),
        400,
        "stream_options",
        None,
        "stream",
    ),
    (
        "role",
        CHAT,
        body(messages=[{"role": "robot", "content": "Hi"}]),
        400,
        "messages.0.role",
        "invalid_type",
        "",
    ),
    (
        "content-type",
        CHAT,
        body(messages=[{"role": "user", "content": 5}]),
        400,
        "messages.0.content",
        None,
        "",
    ),
    ("no-messages", CHAT, body(messages=[]), 400, None, None, "empty prompt"),
    ("blank-prompt", TEXT, {**SHORT_BODY, "prompt": "  "}, 400, None, None, "empty prompt"),
    (
        "many-prompts",
        TEXT,
        {**SHORT_BODY, "prompt": ["a", "b"]},
        400,
        "prompt",
        "unsupported_parameter",
        "one",
    ),
    ("empty-stop", TEXT, {**SHORT_BODY, "stop": [""]}, 400, "stop", None, "stop strings"),
    (
        "theta-auto-uncalibrated",
        TEXT,
        {**SHORT_BODY, "marspec": {"rule": "mars", "theta": "auto"}},
        400,
        "marspec.theta",
        None,
        "marspec calibrate",
    ),
    (
        "theta-word",
        TEXT,
        {**SHORT_BODY, "marspec": {"rule": "mars", "theta": "high"}},
        400,
        "marspec.theta",
        None,
        "theta",
    ),
    ("theta-without-rule", CHAT, body(marspec={"theta": 0.9}), 400, "marspec.rule", None, "add marspec.rule"),
    (
        "too-long-chat",
        CHAT,
        body(messages=chat(TOO_LONG)),
        400,
        "messages",
        "context_length_exceeded",
        "8192",
    ),
    (
        "too-long-text",
        TEXT,
        {**SHORT_BODY, "prompt": TOO_LONG},
        400,
        "prompt",
        "context_length_exceeded",
        "8192",
    ),
    # Text that is not Unicode: a lone UTF-16 surrogate, as a JSON escape or as the raw bytes ED A0 80
    # (Python's JSON reader lets both through as the same character).
    ("surrogate-escape-prompt", TEXT, raw(prompt=f"a{ESCAPE}b"), 400, "prompt", "invalid_unicode", "U+D800"),
    ("surrogate-bytes-prompt", TEXT, raw(prompt="a\ud800b"), 400, "prompt", "invalid_unicode", "U+D800"),
    (
        "surrogate-escape-chat",
        CHAT,
        raw(messages=[{"role": "user", "content": f"a{ESCAPE}b"}]),
        400,
        "messages.0.content",
        "invalid_unicode",
        "U+D800",
    ),
    (
        "surrogate-bytes-chat-part",
        CHAT,
        raw(messages=[{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]),
        400,
        "messages.0.content",
        "invalid_unicode",
        "U+DC00",
    ),
    (
        "surrogate-field-name",
        CHAT,
        raw(messages=chat("Hi"), **{ESCAPE: 1}),
        400,
        None,
        "invalid_unicode",
        "surrogate",
    ),
    # k is bounded where every setting is checked (DecodeConfig): the same line as the library's and CLI's
    ("k-huge", CHAT, body(marspec={"k": 10**10}), 400, "marspec.k", None, f"[1, {MAX_K}]"),
    ("k-int64-max", CHAT, body(marspec={"k": 2**63 - 1}), 400, "marspec.k", None, f"[1, {MAX_K}]"),
    ("k-billion", CHAT, body(marspec={"k": 10**9}), 400, "marspec.k", None, f"[1, {MAX_K}]"),
    ("k-above-max", TEXT, {**SHORT_BODY, "marspec": {"k": MAX_K + 1}}, 400, "marspec.k", None, "k (draft"),
    # Bodies json.loads cannot read for other reasons than syntax: the server's own code, not a generic 400
    ("deep-nesting", CHAT, b"[" * 100_000, 400, None, "invalid_json", "nested too deeply"),
    # Closed nesting deep enough for every Python: 3.13 parses 5,000 levels that 3.11 refuses.
    ("deep-nesting-closed", TEXT, DEEP_CLOSED, 400, None, "invalid_json", "nested too deeply"),
    ("not-utf8", CHAT, b'{"model": "\xff"}', 400, None, "invalid_json", "not UTF-8"),
    (
        "too-long-stream",
        TEXT,
        {**SHORT_BODY, "prompt": TOO_LONG, "stream": True},
        400,
        "prompt",
        None,
        "shorten",
    ),
]


@pytest.mark.parametrize(
    ("path", "payload", "status", "param", "code", "needle"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_INPUTS],
)
def test_bad_input(http: httpx.Client, path, payload, status, param, code, needle) -> None:
    if isinstance(payload, bytes):
        res = http.post(path, content=payload, headers={"Content-Type": "application/json"})
    else:
        res = http.post(path, json=payload)
    assert res.status_code == status, res.text
    assert res.headers["content-type"] == "application/json"
    error = res.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert needle in error["message"]


def test_surely_too_long_prompt_is_refused_before_tokenizing(
    server: ServerProcess, http: httpx.Client
) -> None:
    """1.2 MB of text cannot fit 8,192 tokens of at most 81 bytes each: refused on the HTTP side, so the
    worker never sees it (no generation is counted at all)."""
    before = sum(
        v for (name, _), v in metric_samples(server.url).items() if name == "marspec_generations_total"
    )
    for path, payload, param in [
        (TEXT, {**SHORT_BODY, "prompt": "hello " * 200_000}, "prompt"),
        (CHAT, body(messages=chat("hello " * 200_000)), "messages"),
    ]:
        res = http.post(path, json=payload)
        assert res.status_code == 400, res.text
        error = res.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == param
        assert "at least" in error["message"] and "8192" in error["message"]
    after = sum(
        v for (name, _), v in metric_samples(server.url).items() if name == "marspec_generations_total"
    )
    assert after == before


def test_request_body_over_the_limit_is_413(server: ServerProcess, http: httpx.Client) -> None:
    """The default limit is 4 MB: a larger body is refused before it is parsed, whether its size is
    declared (Content-Length) or only found while reading it (chunked)."""
    big = json.dumps({**SHORT_BODY, "prompt": "x" * (5 * 2**20)}).encode()
    refused_before = metric(server.url, "marspec_requests_total", endpoint=TEXT, status="413")

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(big), 2**16):
            yield big[start : start + 2**16]

    for content in (big, chunks()):
        with httpx.Client(base_url=server.url, timeout=120) as fresh:  # 413 closes the connection
            res = fresh.post(TEXT, content=content, headers={"Content-Type": "application/json"})
        assert res.status_code == 413, res.text
        error = res.json()["error"]
        assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
        assert "--max-request-mb" in error["message"] and "4,194,304" in error["message"]
    assert metric(server.url, "marspec_requests_total", endpoint=TEXT, status="413") == refused_before + 2
    # A body just under the limit is read and answered as usual (here: too long for the context).
    near = {**SHORT_BODY, "prompt": "hello " * 600_000}
    assert len(json.dumps(near)) < 4 * 2**20
    assert http.post(TEXT, json=near).json()["error"]["code"] == "context_length_exceeded"
    assert http.post(TEXT, json=SHORT_BODY).status_code == 200


def test_a_refused_body_still_being_sent_gets_its_413_intact(server: ServerProcess) -> None:
    """The server reads and discards the rest of a refused body before it answers and closes: closing
    with unread bytes makes the kernel reset the connection, which can destroy the 413 on its way (CI
    saw the headers arrive and the body not). A client that is still sending when the server decides
    must receive the whole answer."""
    body = json.dumps({**SHORT_BODY, "prompt": "x" * (5 * 2**20)}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    head = post_head(host, len(body))
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head + body[: 2**20])
        time.sleep(0.5)  # the server has seen the declared length by now
        sock.sendall(body[2**20 :])
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status, _, rest = reply.partition(b"\r\n")
    # The reason phrase is the HTTP library's (h11 says "Request Entity Too Large" or "Content Too Large").
    assert status.startswith(b"HTTP/1.1 413 "), reply[:200]
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_too_large"


def test_k_at_its_maximum_is_accepted(http: httpx.Client) -> None:
    res = http.post(TEXT, json={**SHORT_BODY, "max_tokens": 4, "marspec": {"k": MAX_K}})
    assert res.status_code == 200, res.text
    assert res.json()["marspec"]["k"] == MAX_K


def test_an_error_quotes_at_most_a_little_of_a_huge_value(http: httpx.Client) -> None:
    res = http.post(TEXT, json={**SHORT_BODY, "top_p": "x" * 3_000_000})
    assert res.status_code == 400 and res.json()["error"]["param"] == "top_p"
    assert len(res.json()["error"]["message"]) < 300


def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(
    server: ServerProcess,
) -> None:
    """RFC 9112 section 6.3: a request with both framings may be a smuggling attempt; the server answers
    it and MUST close the connection. A request pipelined behind it on the same connection is never
    served (uvicorn's h11 alone would read the chunked body, answer 200 and serve the next one)."""
    host, port = server.url.removeprefix("http://").split(":")
    payload = json.dumps({**SHORT_BODY, "max_tokens": 1}).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)
    smuggled = (
        f"POST {TEXT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(chunked)}\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode() + chunked
    behind = f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(smuggled + behind)
        reply = b""
        while chunk := sock.recv(65536):  # ends when the server closes (a timeout here fails the test)
            reply += chunk
    assert reply.count(b"HTTP/1.1 ") == 1, reply  # one answer, and nothing for the pipelined request
    head, _, rest = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head.lower(), head
    error = json.loads(rest)["error"]
    assert error["code"] == "ambiguous_framing" and "Transfer-Encoding" in error["message"]


def test_unknown_route_and_method_are_json_errors(http: httpx.Client) -> None:
    res = http.get("/v1/engines")
    assert res.status_code == 404 and res.json()["error"]["message"] == "Not Found"
    res = http.get("/v1/chat/completions")
    assert res.status_code == 405 and "error" in res.json()


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-9", messages=chat("Hi"))
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL, messages=chat("Hi"), extra_body={"marspec": {"rule": "mars", "theta": 2}}
        )
    assert bad.value.param == "marspec.theta" and "theta" in bad.value.message


# ---------------------------------------------------------------------------------------------------------
# Load behaviour: one generation at a time, a bounded queue, cancellation


class Background:
    """A request sent from a thread. ``join()`` gives (status, body, headers): the JSON body, or for a
    stream the list of its non-empty lines; or the exception the request raised."""

    def __init__(self, url: str, path: str, payload: dict[str, Any]) -> None:
        self.result: Any = None
        self.thread = threading.Thread(target=self._run, args=(url + path, payload))
        self.thread.start()

    def _run(self, url: str, payload: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", url, json=payload, timeout=120) as res:
                if payload.get("stream") and res.status_code == 200:
                    content: Any = [line for line in res.iter_lines() if line]
                else:
                    content = json.loads(res.read())
                self.result = (res.status_code, content, res.headers)
        except Exception as exc:
            self.result = exc

    def join(self) -> Any:
        self.thread.join(120)
        assert not isinstance(self.result, Exception), self.result
        return self.result


class OpenStream:
    """A streaming request whose first event has arrived (so its generation is running), left unread."""

    def __init__(self, url: str, payload: dict[str, Any]) -> None:
        self.client = httpx.Client(base_url=url, timeout=120)
        self.response = self.client.send(
            self.client.build_request("POST", TEXT, json={**payload, "stream": True}), stream=True
        )
        assert self.response.status_code == 200
        # Keep the iterator: dropping a half-read one makes httpx close the connection.
        self.lines = self.response.iter_lines()
        self.first = next(self.lines)
        assert self.first.startswith("data: {")

    def text(self) -> str:
        """Read the stream to its end: the text of all its events, the first included."""
        lines = [self.first, *self.lines]
        events = [
            json.loads(line.removeprefix("data: ")) for line in lines if line and line != "data: [DONE]"
        ]
        return "".join(event["choices"][0]["text"] for event in events if event.get("choices"))

    def close(self) -> None:
        """Hang up, as a client that goes away does."""
        self.response.close()
        self.client.close()


def test_queue_full_429_then_disconnect_cancels(server: ServerProcess, client: openai.OpenAI) -> None:
    expected = client.completions.create(**SHORT_BODY).choices[0].text
    cancelled = metric(server.url, "marspec_generations_total", outcome="cancelled_disconnect")
    running = OpenStream(server.url, LONG_BODY)  # generating; 400 tokens take ~20 s
    waiting = Background(server.url, TEXT, SHORT_BODY)  # the one queue slot (--max-queue 1)
    wait_until(lambda: metric(server.url, "marspec_queue_depth") == 1)

    refused = httpx.post(f"{server.url}{TEXT}", json=SHORT_BODY)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert refused.json()["error"]["code"] == "queue_full"
    with pytest.raises(openai.RateLimitError):
        client.completions.create(**SHORT_BODY)

    running.close()  # the client goes away: its generation is cancelled between two decode steps
    status, answer, _ = waiting.join()
    assert status == 200 and answer["choices"][0]["text"] == expected  # the cancel left no stale state
    assert metric(server.url, "marspec_generations_total", outcome="cancelled_disconnect") == cancelled + 1


def test_non_streaming_disconnect_cancels(server: ServerProcess) -> None:
    """A client that hangs up while its (non-streaming) generation runs: sent on a socket of its own,
    closed once the server reports the model busy, so the hang-up lands mid-generation whatever the
    machine's load."""
    cancelled = metric(server.url, "marspec_generations_total", outcome="cancelled_disconnect")
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps(LONG_BODY).encode()
    head = post_head(host, len(body))
    wait_until(lambda: metric(server.url, "marspec_busy") == 0)  # so that busy below means this request
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head + body)
        wait_until(lambda: metric(server.url, "marspec_busy") == 1)  # generating: 400 tokens take ~20 s
    wait_until(
        lambda: metric(server.url, "marspec_generations_total", outcome="cancelled_disconnect") > cancelled
    )
    assert metric(server.url, "marspec_requests_total", endpoint=TEXT, status="499") >= 1
    wait_until(lambda: metric(server.url, "marspec_busy") == 0)  # the model is free again
    assert httpx.post(f"{server.url}{TEXT}", json=SHORT_BODY, timeout=120).status_code == 200


def test_queued_past_its_time_limit_is_503_while_the_model_is_still_busy(server: ServerProcess) -> None:
    running = OpenStream(server.url, LONG_BODY)
    wait_until(lambda: metric(server.url, "marspec_busy") == 1)
    # The long generation holds the model (400 tokens take ~20 s); the late request's 0.5 s pass in the
    # queue and it is answered then, not when the long one ends and frees the model.
    late = Background(server.url, TEXT, {**SHORT_BODY, "marspec": {"timeout": 0.5}})
    status, answer, headers = late.join()
    still_busy = metric(server.url, "marspec_busy") == 1
    running.close()
    assert status == 503 and answer["error"]["code"] == "queue_timeout"
    assert answer["error"]["type"] == "service_unavailable" and int(headers["Retry-After"]) >= 1
    assert still_busy


def token_bytes_text(logprobs: list[dict[str, Any]]) -> str:
    """The text a completion's tokens decode to, from the bytes its logprobs list."""
    return bytes(b for entry in logprobs for b in entry["bytes"]).decode("utf-8", errors="replace")


@pytest.mark.parametrize("max_tokens", [4, 13])
def test_the_text_is_the_decoding_of_its_tokens_whole_or_streamed_for_every_rule(
    http: httpx.Client, max_tokens: int
) -> None:
    """SmolLM2 answers this chat with emoji, each several tokens: at 4 tokens the text ends inside one,
    and a speculative step commits several of its tokens at once."""
    texts = {}
    for rule in ("plain", "strict", "mars"):
        body = {
            "model": MODEL,
            "messages": chat("\U0001f600 hey"),
            "max_tokens": max_tokens,
            "logprobs": True,
            "marspec": {"rule": rule},
        }
        whole = http.post(CHAT, json=body).json()
        text = whole["choices"][0]["message"]["content"]
        assert text == token_bytes_text(whole["choices"][0]["logprobs"]["content"]), rule
        with http.stream("POST", CHAT, json={**body, "stream": True}) as res:
            lines = [line.removeprefix("data: ") for line in res.iter_lines() if line.startswith("data: {")]
        chunks = [json.loads(line)["choices"] for line in lines]
        streamed = "".join(c[0]["delta"].get("content") or "" for c in chunks if c)
        assert streamed == text, rule
        texts[rule] = text
    assert texts["strict"] == texts["plain"]  # lossless: the same tokens, so the same text
    assert "\U0001f600" in texts["plain"]


def test_no_server_errors_so_far(server: ServerProcess) -> None:
    """Everything above, bad input included, was answered without a single 5xx other than the deliberate
    queue-timeout 503s."""
    errors = {
        labels: value
        for (name, labels), value in metric_samples(server.url).items()
        if name == "marspec_requests_total" and dict(labels)["status"].startswith("5")
    }
    queue_timeouts = errors.pop((("endpoint", TEXT), ("status", "503")), 0.0)
    assert errors == {}
    assert queue_timeouts == metric(server.url, "marspec_generations_total", outcome="timed_out")


# ---------------------------------------------------------------------------------------------------------
# API key: a server started with --api-key KEY while MARSPEC_API_KEY holds another (the flag wins)

KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with pytest.MonkeyPatch.context() as env:  # the child inherits the environment at its start
        env.setenv("MARSPEC_API_KEY", "the-environment-key")
        proc = launch([*BASE_FLAGS, "--api-key", KEY], tmp_path_factory.mktemp("keyed") / "server.log")
    yield proc
    assert proc.stop() == 0, proc.log()
    assert "Traceback" not in proc.log() and KEY not in proc.log()  # the key is never logged


def test_the_openai_client_with_the_right_key_works(keyed_server: ServerProcess) -> None:
    assert "(API key required)" in keyed_server.log()
    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    res = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=4)
    assert res.choices[0].text and res.usage.completion_tokens == 4
    assert [m.id for m in client.models.list()] == [MODEL]


@pytest.mark.parametrize("api_key", ["wrong-key", "the-environment-key", KEY + "x", KEY[:-1]])
def test_a_wrong_key_is_an_authentication_error(keyed_server: ServerProcess, api_key: str) -> None:
    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=api_key, max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError) as refused:
        client.chat.completions.create(model=MODEL, messages=chat("Hi"), max_tokens=4)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert refused.value.type == "invalid_request_error"


def test_a_missing_key_is_401_in_openais_format(keyed_server: ServerProcess) -> None:
    # (The openai client itself refuses to start without a key.)
    forms = ({}, {"Authorization": "Bearer"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY})
    for headers in forms:
        res = httpx.post(f"{keyed_server.url}{TEXT}", json=SHORT_BODY, headers=headers, timeout=120)
        assert res.status_code == 401 and res.headers["WWW-Authenticate"] == "Bearer", res.text
        error = res.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "missing_api_key"
        assert "Authorization: Bearer" in error["message"]
    # The scheme's case does not matter (RFC 9110); a key sent twice is ambiguous, so refused.
    res = httpx.post(
        f"{keyed_server.url}{TEXT}", json=SHORT_BODY, headers={"Authorization": f"bearer {KEY}"}, timeout=120
    )
    assert res.status_code == 200, res.text
    twice = [("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {KEY}")]
    res = httpx.post(f"{keyed_server.url}{TEXT}", json=SHORT_BODY, headers=twice, timeout=120)
    assert res.status_code == 401


def test_health_is_open_and_metrics_need_the_key(keyed_server: ServerProcess) -> None:
    url = keyed_server.url
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/v1/no-such-route").status_code == 401  # routes are not revealed either
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert metrics.status_code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.text)
        for s in family.samples
    }
    assert samples[("marspec_requests_total", (("endpoint", TEXT), ("status", "401")))] >= 1


def test_the_api_key_is_read_from_the_environment() -> None:
    """A key the server cannot use is refused at start, from the variable as from the flag."""
    for args, env in (([], {"MARSPEC_API_KEY": "has a space"}), (["--api-key", "has a space"], {})):
        result = runner.invoke(app, ["serve", *BASE_FLAGS, *args], env=env)
        assert result.exit_code == 2, result.output
        assert result.output.startswith("error: --api-key (or MARSPEC_API_KEY) must be"), result.output


# ---------------------------------------------------------------------------------------------------------
# Time limit and SIGTERM, on a server with a 2 s shutdown grace

# The time-limit tests' own limit (marspec.timeout goes the way of --request-timeout: the job's deadline).
SHORT_LIMIT_S = 3.0


@pytest.fixture(scope="module")
def short_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # The server-wide limit outlasts the SIGTERM test's grace, so that a request's own limit never ends
    # it first, whatever the machine's load.
    flags = [
        *BASE_FLAGS,
        "--request-timeout",
        "60",
        "--shutdown-grace",
        "2",
        "--max-queue",
        "4",
        "--max-batch",
        "1",
    ]
    proc = launch(flags, tmp_path_factory.mktemp("short") / "server.log")
    yield proc
    proc.stop()  # normally already stopped by the SIGTERM test


def test_time_limit_returns_text_so_far(short_server: ServerProcess) -> None:
    body = {**LONG_BODY, "marspec": {"rule": "plain", "timeout": SHORT_LIMIT_S}}
    start = time.monotonic()
    res = httpx.post(f"{short_server.url}{TEXT}", json=body, timeout=120)
    # timing-guard: a lower bound the request's own limit sets; a slower machine only waits longer
    assert time.monotonic() - start >= SHORT_LIMIT_S
    assert res.status_code == 200
    answer = res.json()
    assert answer["choices"][0]["finish_reason"] == "length" and answer["choices"][0]["text"].startswith(
        " 4,"
    )
    assert answer["marspec"]["timed_out"] is True
    assert 0 < answer["usage"]["completion_tokens"] < LONG_BODY["max_tokens"]


def test_time_limit_in_a_stream(short_server: ServerProcess) -> None:
    c = openai.OpenAI(base_url=f"{short_server.url}/v1", api_key="unused", max_retries=0)
    chunks = list(
        c.completions.create(
            model=MODEL,
            prompt=LONG_BODY["prompt"],
            max_tokens=400,
            stream=True,
            extra_body={"marspec": {"rule": "plain", "timeout": SHORT_LIMIT_S}},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks).startswith(" 4,")
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].model_extra["marspec"]["timed_out"] is True


def test_sigterm_drains_then_exits_0(short_server: ServerProcess) -> None:
    """SIGTERM with a long generation streaming and a short one queued: new connections are refused at
    once, the stream runs on until the 2 s grace ends and then gets a clean error event, the queued
    request (behind it all the grace) gets a 503, and the process exits 0. That work ending within the
    grace finishes normally is the engine test below, with a grace no machine's load outlasts."""
    url = short_server.url
    # ~1,000 tokens of counting: minutes of decoding, so it is still running when the grace ends.
    running = OpenStream(url, {**LONG_BODY, "max_tokens": 1000})
    queued = Background(url, TEXT, SHORT_BODY)
    wait_until(lambda: metric(url, "marspec_queue_depth") == 1)

    terminated = time.monotonic()
    short_server.proc.terminate()
    wait_until(lambda: not accepts_connections(url))  # it stops listening at once

    events = [line for line in running.lines if line]
    # timing-guard: a lower bound the server's grace sets (it was not cut at the signal); slower only waits
    assert time.monotonic() - terminated >= 2
    running.close()
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e.removeprefix("data: "))["choices"] for e in events[:-2])
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "shutting_down" and error["type"] == "service_unavailable"
    status, answer, _ = queued.join()
    assert status == 503 and answer["error"]["code"] == "shutting_down"

    assert short_server.proc.wait(120) == 0
    assert "Traceback" not in short_server.log()


def test_a_drain_lets_running_and_queued_work_finish_within_the_grace() -> None:
    """After begin_shutdown the engine refuses new jobs with a 503 and lets the running and the queued
    job run to their ends within the grace, as on SIGTERM (the server calls begin_shutdown then)."""
    decoder = Decoder(MODEL, "ngram")

    async def drain() -> list[Event]:
        engine = Engine(decoder, max_queue=4, shutdown_grace=600.0)
        engine.start()
        try:
            options = GenerationOptions(max_new_tokens=SHORT_BODY["max_tokens"])
            jobs = [Job(SHORT_BODY["prompt"], options, timeout=None) for _ in range(2)]
            for job in jobs:
                engine.submit(job)
            started = await jobs[0].events.get()
            assert isinstance(started, Delta), started  # the first one is running, the second queued
            engine.begin_shutdown()
            with pytest.raises(ApiError) as refused:
                engine.submit(Job(SHORT_BODY["prompt"], options, timeout=None))
            assert refused.value.status == 503 and refused.value.code == "shutting_down"
            return [await last_event(job) for job in jobs]
        finally:
            engine.close()

    for event in asyncio.run(drain()):
        assert isinstance(event, Finished), event
        assert event.outcome.finish_reason == "length" and not event.outcome.timed_out
        assert event.outcome.completion_tokens == SHORT_BODY["max_tokens"]


async def last_event(job: Job) -> Event:
    while not isinstance(event := await job.events.get(), (Finished, Failed)):
        pass
    return event


def test_a_request_naming_no_time_limit_takes_the_servers() -> None:
    body = CompletionRequest.model_validate(SHORT_BODY)
    for limit in (3.0, None):
        settings = ServerSettings(MODEL, request_timeout=limit)
        gen = parse_request(body, settings, context_length=8192, has_drafter=True)
        assert gen.timeout == limit


def test_theta_auto_server_uses_the_pairs_calibration(tmp_path, monkeypatch) -> None:
    import torch

    from marspec.calibration import Choice, save_choice
    from marspec.precision import choose_precision

    monkeypatch.setenv("MARSPEC_CALIBRATION_DIR", str(tmp_path / "calibrations"))
    flags = [*BASE_FLAGS, "--rule", "mars", "--theta", "auto"]
    refused = runner.invoke(app, ["serve", *flags])
    assert refused.exit_code == 2 and "marspec calibrate" in refused.output  # no calibration yet
    # Stored for the precision the server loads the model in, naming none: a calibration is a model's.
    quant = choose_precision(MODEL, "auto", "auto", torch.device("cpu")).target_quant
    save_choice(MODEL, "ngram", Choice("prob_ratio", 0.05, 0.99, True, "test", 0.0, {}), quant)
    proc = launch(flags, tmp_path / "server.log")  # the child inherits MARSPEC_CALIBRATION_DIR
    try:
        with httpx.Client(base_url=proc.url, timeout=120) as c:
            auto = c.post(TEXT, json={**SHORT_BODY, "prompt": LIST_PROMPT, "max_tokens": 24}).json()
            explicit = c.post(
                TEXT,
                json={
                    **SHORT_BODY,
                    "prompt": LIST_PROMPT,
                    "max_tokens": 24,
                    "marspec": {"theta": 0.05, "margin": "prob_ratio"},
                },
            ).json()
            card = c.get(f"/v1/models/{MODEL}").json()["marspec"]
        assert auto["choices"][0]["text"] == explicit["choices"][0]["text"]
        assert auto["marspec"]["accepted_relaxed"] == explicit["marspec"]["accepted_relaxed"]
        assert (auto["marspec"]["theta"], auto["marspec"]["margin"]) == (0.05, "prob_ratio")  # resolved
        assert card["greedy"] == {"margin": "prob_ratio", "theta": 0.05}
        assert "marspec calibrate" in card["sampling"]["error"]  # only greedy was calibrated
    finally:
        assert proc.stop() == 0


# ---------------------------------------------------------------------------------------------------------
# Continuous batching: requests decoded together answer what each answers alone


@pytest.fixture(scope="module")
def batch_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = [*BASE_FLAGS, "--max-batch", "2", "--max-queue", "4"]
    proc = launch(flags, tmp_path_factory.mktemp("batch") / "server.log")
    yield proc
    assert proc.stop() == 0, proc.log()
    assert "Traceback" not in proc.log()


# Greedy strict, MARS at the paper's setting (which relaxes on this chat), seeded sampling and plain:
# each request's own settings, through both endpoints.
MARS_PAPER = {"rule": "mars", "theta": 0.9, "margin": "logit_ratio", "k": 4}
BATCH_REQUESTS = [
    (TEXT, {"model": MODEL, "prompt": LIST_PROMPT, "max_tokens": 40, "marspec": {"rule": "strict"}}),
    (CHAT, {"model": MODEL, "messages": chat(EXPLAIN_PROMPT), "max_tokens": 40, "marspec": MARS_PAPER}),
    (TEXT, {"model": MODEL, "prompt": EXPLAIN_PROMPT, "max_tokens": 30, "temperature": 0.8, "seed": 7}),
    (TEXT, {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 24, "marspec": {"rule": "plain"}}),
]


def choice_text(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_requests_decoded_together_answer_as_each_does_alone(batch_server: ServerProcess) -> None:
    url = batch_server.url
    alone = [httpx.post(f"{url}{path}", json=body, timeout=120).json() for path, body in BATCH_REQUESTS]
    # A long generation holds one slot while the four requests come at once: each is decoded beside it
    # or beside another of them, the rest wait and join as slots free up.
    running = OpenStream(url, LONG_BODY)
    together = [Background(url, path, body) for path, body in BATCH_REQUESTS]
    answers = [b.join() for b in together]
    running.close()
    for (status, answer, _), solo_answer in zip(answers, alone, strict=True):
        assert status == 200
        assert choice_text(answer) == choice_text(solo_answer)
        assert answer["marspec"]["relaxed_positions"] == solo_answer["marspec"]["relaxed_positions"]
    assert alone[1]["marspec"]["relaxed_positions"]  # MARS relaxed, alone and together
    assert metric(url, "marspec_batch_peak") == 2  # target forwards served two requests at once


def test_a_request_leaving_a_batch_does_not_disturb_the_other(batch_server: ServerProcess) -> None:
    url = batch_server.url
    body = {**LONG_BODY, "max_tokens": 60, "marspec": {"rule": "strict"}}
    expected = httpx.post(f"{url}{TEXT}", json=body, timeout=120).json()["choices"][0]["text"]
    leaving = OpenStream(url, LONG_BODY)  # decoding, then gone while the next one decodes beside it
    staying = OpenStream(url, body)
    leaving.close()
    text = staying.text()
    staying.close()
    assert text == expected
    assert metric(url, "marspec_batch_peak") == 2
    wait_until(lambda: metric(url, "marspec_batch_size") == 0)
