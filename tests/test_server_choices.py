"""The server's ``logprobs`` / ``top_logprobs`` and ``n``, in OpenAI's shapes: an app in this process
serving the tiny random pair (selftest's), talked to through FastAPI's TestClient and read back with the
openai client's own types."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from marspec.selftest.tiny import tiny_decoder
from marspec.serve.app import create_app
from marspec.serve.logprobs import token_text
from marspec.serve.settings import ServerSettings

MODEL = "tiny"
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory):
    decoder = tiny_decoder(tmp_path_factory.mktemp("tiny"), torch.device("cpu"))
    # A template of the tiny vocabulary's characters (it has no newline), for the chat route.
    decoder.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return decoder


@pytest.fixture(scope="module")
def http(decoder) -> Iterator[TestClient]:
    app = create_app(decoder, ServerSettings(MODEL, max_queue=8))
    with TestClient(app) as client:
        yield client


def text_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": 12, **fields}


def chat_body(**fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 12,
        **fields,
    }


def ok(http: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def chunks(http: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completion_logprobs_are_the_librarys(http, decoder) -> None:
    body = text_body(logprobs=3, marspec={"rule": "mars", "theta": 0.0})
    answer = ok(http, TEXT, body)
    parsed = openai.types.Completion.model_validate(answer)
    logprobs = parsed.choices[0].logprobs
    assert logprobs is not None and "".join(logprobs.tokens) == parsed.choices[0].text
    library = decoder.generate(
        "Hello there", chat=False, rule="mars", theta=0.0, max_new_tokens=12, logprobs=3
    )
    assert logprobs.token_logprobs == pytest.approx([t.logprob for t in library.logprobs])
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(12)]


def test_chat_logprobs_in_openais_shape(http) -> None:
    answer = ok(http, CHAT, chat_body(logprobs=True, top_logprobs=2))
    parsed = openai.types.chat.ChatCompletion.model_validate(answer)
    content = parsed.choices[0].logprobs.content
    assert "".join(t.token for t in content) == parsed.choices[0].message.content
    for token in content:
        assert token.bytes == list(token.token.encode()) and len(token.top_logprobs) == 2
        assert token.logprob <= token.top_logprobs[0].logprob + 1e-6
        assert [t.logprob for t in token.top_logprobs] == sorted(
            (t.logprob for t in token.top_logprobs), reverse=True
        )
    without_alternatives = ok(http, CHAT, chat_body(logprobs=True))["choices"][0]["logprobs"]["content"]
    assert [t["logprob"] for t in without_alternatives] == [t.logprob for t in content]
    assert all(t["top_logprobs"] == [] for t in without_alternatives)
    assert ok(http, CHAT, chat_body())["choices"][0]["logprobs"] is None  # not asked


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_a_stream_carries_the_logprobs_of_each_delta(http, path) -> None:
    body = chat_body(logprobs=True, top_logprobs=1) if path == CHAT else text_body(logprobs=1)
    whole = ok(http, path, body)["choices"][0]["logprobs"]
    streamed = chunks(http, path, body)
    if path == CHAT:  # (openai's Completion type has no null finish_reason, which text chunks carry)
        for chunk in streamed:
            openai.types.chat.ChatCompletionChunk.model_validate(chunk)
    parts = [c["choices"][0]["logprobs"] for c in streamed if c["choices"][0]["logprobs"]]
    assert len(parts) > 1
    if path == CHAT:
        assert [t for p in parts for t in p["content"]] == whole["content"]
        texts = [c["choices"][0]["delta"].get("content", "") for c in streamed]
        assert all("".join(t["token"] for t in p["content"]) for p in parts)
        assert "".join(texts) == "".join(t["token"] for t in whole["content"])
    else:
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for p in parts for x in p[key]] == whole[key], key


def test_n_choices_with_a_seed_begin_with_the_single_answer(http) -> None:
    # Hot enough that three seeds on the tiny model's peaked distributions do not all draw one text.
    body = text_body(temperature=2.0, seed=7, max_tokens=10)
    single = ok(http, TEXT, body)
    three = ok(http, TEXT, {**body, "n": 3})
    openai.types.Completion.model_validate(three)
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert three["choices"][0]["text"] == single["choices"][0]["text"]
    assert len({c["text"] for c in three["choices"]}) > 1  # each its own seed
    assert three["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
    assert three["usage"]["completion_tokens"] == 30
    assert three["usage"]["total_tokens"] == single["usage"]["prompt_tokens"] + 30
    assert [c["new_tokens"] for c in three["marspec"]["choices"]] == [10, 10, 10]
    assert three["marspec"]["rule"] == single["marspec"]["rule"]
    greedy = ok(http, CHAT, chat_body(n=2))  # greedy: equal choices, as OpenAI's
    assert greedy["choices"][0]["message"] == greedy["choices"][1]["message"]


def test_n_choices_stream_tagged_by_index(http) -> None:
    body = chat_body(temperature=1.0, seed=3, n=3, logprobs=True, stream_options={"include_usage": True})
    whole = ok(http, CHAT, {k: v for k, v in body.items() if k != "stream_options"})
    streamed = chunks(http, CHAT, body)
    texts, finished = {0: "", 1: "", 2: ""}, []
    for chunk in streamed[:-1]:
        openai.types.chat.ChatCompletionChunk.model_validate(chunk)
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finished.append(choice["index"])
            assert chunk["marspec"]["new_tokens"] == 12
    assert sorted(finished) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    assert streamed[-1]["choices"] == [] and streamed[-1]["usage"] == whole["usage"]


BAD = [
    ("top-without-logprobs", CHAT, chat_body(top_logprobs=2), "top_logprobs", "set logprobs=true"),
    ("top-above-20", CHAT, chat_body(logprobs=True, top_logprobs=21), "top_logprobs", "[0, 20]"),
    ("top-negative", CHAT, chat_body(logprobs=True, top_logprobs=-1), "top_logprobs", "[0, 20]"),
    ("chat-logprobs-number", CHAT, chat_body(logprobs=1), "logprobs", ""),
    ("completion-logprobs-above-5", TEXT, text_body(logprobs=6), "logprobs", "[0, 5]"),
    ("completion-logprobs-bool", TEXT, text_body(logprobs=True), "logprobs", ""),
    ("n-zero", CHAT, chat_body(n=0), "n", "[1, 8]"),
    ("n-above-8", TEXT, text_body(n=9), "n", "[1, 8]"),
    ("best-of", TEXT, text_body(best_of=2), "best_of", "picks none"),
]


@pytest.mark.parametrize(("path", "body", "param", "needle"), [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_bad_values_are_400_naming_the_parameter(http, path, body, param, needle) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"] and "\n" not in error["message"]


def test_queue_counts_each_choice(decoder) -> None:
    app = create_app(decoder, ServerSettings(MODEL, max_queue=1))
    with TestClient(app) as client:
        response = client.post(TEXT, json=text_body(n=3))
        assert response.status_code == 429
        while app.state.engine.busy:  # the first choice may have started before it was cancelled
            time.sleep(0.01)
        assert ok(client, TEXT, text_body(n=2))["usage"]["completion_tokens"] == 24


class _FragmentTokenizer:
    """Decodes every token to U+FFFD, as a piece of a multi-byte character decodes alone."""

    def __init__(self, pieces: dict[int, str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "\ufffd"

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]


def test_a_token_that_is_part_of_a_character_has_its_own_bytes() -> None:
    tokenizer = _FragmentTokenizer({0: "\u00e2\u0120", 1: "<0xE2>", 2: "\u2581x"})
    assert token_text(tokenizer, 0) == ("\ufffd", (0xE2, 0x20))  # byte-level BPE: "Ġ" is the space
    assert token_text(tokenizer, 1) == ("\ufffd", (0xE2,))  # SentencePiece's byte fallback
    assert token_text(tokenizer, 2) == ("\ufffd", (0xEF, 0xBF, 0xBD))  # neither: the text's bytes
