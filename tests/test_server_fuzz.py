"""A standing fuzz test of the HTTP API (issue 82): hypothesis draws request bodies from the endpoints'
schemas (each field a plausible value, an edge value, or any JSON at all; fields left out at random),
malformed JSON and random routes, and sends them to an app in this process serving the tiny random pair.
Every answer must come, in time, and be a 2xx or a 4xx in OpenAI's error format: never a 5xx.

Deterministic (``derandomize``): CI replays the same examples, so a failure is reproducible; bounded by
its example count, one request's time limit and a short default ``max_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marspec.api import GenerationOptions
from marspec.selftest.tiny import tiny_decoder
from marspec.serve.app import create_app
from marspec.serve.settings import ServerSettings

MODEL = "tiny"
EXAMPLES = 120

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(["\ud800", "\udfff", "\U0001f600", "", " ", "\x00"]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


valid_texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=12) | st.just("\U0001f600 hi")
# Each field's values the API accepts (edge ones among them) and values it must refuse.
marspec_valid = st.fixed_dictionaries(
    {},
    optional={
        "rule": st.sampled_from(["plain", "strict", "mars", "block"]),
        "k": st.integers(1, 8),
        "timeout": st.sampled_from([0.1, 0.5, 2.0]),
    },
)
VALID = {
    "max_tokens": st.integers(1, 6),
    "temperature": st.sampled_from([0, 0.0, 1e-300, 5e-324, 1e-38, 1e-5, 0.7, 2.0]) | st.floats(0, 2),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": valid_texts | st.lists(valid_texts, max_size=4),
    "stream": st.booleans(),
    "n": st.integers(1, 3),
    "user": valid_texts,
    "top_p": st.just(1),
    "logit_bias": st.just({}),
    "marspec": marspec_valid,
}
INVALID = {
    "model": st.sampled_from(["gpt-4", "", None, 3]),
    "max_tokens": st.sampled_from([0, -1, 2**31, 2**63, 10**30, 1.5, "4", True]),
    "temperature": st.sampled_from([-1.0, -1e-300, 2.5, 1e308, "0.5"]),
    "seed": st.sampled_from([2**63, -(2**63) - 1, 1.0]),
    "stop": st.sampled_from(["\ud800", ["ok", "\udc00x"], [1], ["a"] * 50, ""]),
    "n": st.sampled_from([0, -1, 9, 10**9]),
    "top_p": st.sampled_from([0.5, 0, None, "1"]),
    "logit_bias": st.just({"5": 10}),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "marspec": st.fixed_dictionaries(
        {},
        optional={
            "rule": st.sampled_from(["typical", "fly", "nope", ""]),
            "theta": st.floats(-1, 2) | st.just("auto"),
            "margin": st.sampled_from(["prob_ratio", "logit_gap", "x"]),
            "k": st.sampled_from([0, 65, 10**10, 2**63 - 1]),
            "timeout": st.sampled_from([0, -1, 1e-9, 0.05, 1e300]),
        },
    ),
    "prompt": st.sampled_from(["\ud800", "a\udc00b", ["a", "b"], [], [1, 2], "ab" * 400]),
    "messages": st.sampled_from([[], [{"role": "tool", "content": "x"}], [{"role": "user"}], "hi"]),
    "logprobs": st.sampled_from([-1, 6, 21, "yes"]),
    "top_logprobs": st.sampled_from([-1, 21, 3]),
}
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "developer"]),
            "content": valid_texts
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": valid_texts})),
        }
    ),
    min_size=1,
    max_size=3,
)
chat_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": messages},
    optional={**VALID, "max_completion_tokens": st.integers(1, 6), "logprobs": st.booleans()},
)
text_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": valid_texts | st.lists(valid_texts, min_size=1, max_size=1)},
    optional={**VALID, "logprobs": st.integers(0, 5), "echo": st.just(False)},
)


def spoil(bodies: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Any]:
    """Bodies the API accepts, then sometimes one field replaced by a value it must refuse or by any
    JSON at all, and sometimes not an object."""
    bad_field = st.sampled_from(sorted(INVALID)).flatmap(lambda name: st.tuples(st.just(name), INVALID[name]))
    broken = st.tuples(bodies, bad_field).map(lambda t: {**t[0], t[1][0]: t[1][1]})
    anything = st.tuples(bodies, st.text(max_size=16), json_values).map(lambda t: {**t[0], t[1]: t[2]})
    return st.one_of(bodies, bodies, broken, anything, json_values)


# (method, path, raw body or None): the completion endpoints with drawn bodies, sometimes not even JSON
# (NaN and Infinity are Python's JSON, not JSON); every other route with any method.
requests = st.one_of(
    st.tuples(st.just("POST"), st.just("/v1/chat/completions"), spoil(chat_bodies)),
    st.tuples(st.just("POST"), st.just("/v1/completions"), spoil(text_bodies)),
    st.tuples(
        st.sampled_from(["POST"]),
        st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
        st.sampled_from(['{"model": "tiny", "prompt": NaN}', "{", "[]", "\xff", '{"a":' * 50]),
    ),
    st.tuples(
        st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE"]),
        st.sampled_from(["/health", "/metrics", "/v1/models", "/v1/models/tiny", "/v1/models/x", "/nope"]),
        st.none() | json_values,
    ),
)


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    decoder = tiny_decoder(tmp_path_factory.mktemp("tiny"), torch.device("cpu"))
    decoder.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    # Short answers and a short time limit keep each example cheap, whatever it asks for.
    serving = ServerSettings(MODEL, defaults=GenerationOptions(max_new_tokens=4), request_timeout=2.0)
    with TestClient(create_app(decoder, serving), raise_server_exceptions=False) as client:
        yield client


def encode(body: Any) -> bytes:
    if isinstance(body, str):
        return body.encode("utf-8", errors="surrogatepass")
    return json.dumps(body).encode()  # ASCII: escapes lone surrogates as JSON does


@settings(
    max_examples=EXAMPLES,
    deadline=None,  # one example's time is bounded by the server's own limit, checked below
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests)
def test_no_request_gets_a_server_error(http: TestClient, request: tuple[str, str, Any]) -> None:
    method, path, body = request
    content = None if body is None else encode(body)
    headers = {"Content-Type": "application/json"}
    with http.stream(method, path, content=content, headers=headers, timeout=30) as answer:
        raw = answer.read()
    assert answer.status_code < 500, (request, raw[:500])
    if answer.status_code >= 400 and method != "HEAD":
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and error["message"], request
    if answer.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", (request, raw[-500:])
        assert not any('"server_error"' in event for event in events), (request, raw[-500:])
