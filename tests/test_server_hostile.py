"""The server under careless and hostile clients (issue 82): one request never fails another, every
refusal is a 4xx naming its reason, and connections cannot be held by half-sent requests. Apps in this
process serving the tiny random pair (selftest's), through FastAPI's TestClient or a real uvicorn on
loopback."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from marspec.api import Decoder
from marspec.backends.int8 import rowwise_int8_available
from marspec.selftest.tiny import noisy_copy, save_tiny_model, tiny_decoder, tiny_model, tiny_tokenizer
from marspec.serve.app import create_app
from marspec.serve.server import HeaderTimeoutProtocol, bind_socket, uvicorn_config
from marspec.serve.settings import ServerSettings

MODEL = "tiny"
TEXT = "/v1/completions"


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory):
    """The tiny pair on the CPU's default engine where it runs (an int8 target: forwards packed, so one
    sequence's failure once reached every sequence of the forward)."""
    quant = "int8" if rowwise_int8_available() else "none"
    return tiny_decoder(tmp_path_factory.mktemp("tiny"), torch.device("cpu"), target_quant=quant)


@pytest.fixture(scope="module")
def http(decoder) -> Iterator[TestClient]:
    with TestClient(create_app(decoder, ServerSettings(MODEL, max_queue=8, max_batch=4))) as client:
        yield client


def text_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": 8, **fields}


def counter(http: TestClient, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_a_tiny_temperature_beside_healthy_requests_fails_none_of_them(http, decoder) -> None:
    healthy = [
        text_body(prompt="Hello there", marspec={"rule": "strict"}),
        text_body(prompt="Once upon", temperature=0.8, seed=3, marspec={"rule": "plain"}),
    ]
    poisoned = text_body(prompt="Hi", temperature=1e-300, seed=1)
    solo = [http.post(TEXT, json=body).json()["choices"][0]["text"] for body in healthy]
    answers = concurrently(http, [poisoned, *healthy])
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    assert [a.json()["choices"][0]["text"] for a in answers[1:]] == solo
    greedy = decoder.generate("Hi", max_new_tokens=8, chat=False).text
    assert answers[0].json()["choices"][0]["text"] == greedy  # below the floor: greedy
    assert http.app.state.engine._scheduler.peak >= 2  # type: ignore[attr-defined]  # decoded together


def test_a_prompt_the_model_cannot_read_is_400_and_its_batch_mates_answer_as_alone(tmp_path) -> None:
    """A tokenizer that knows a token its model lacks (an added token): the request whose prompt holds
    it is told so (400) and the requests batched beside it answer as they do alone (its forward once
    failed the packed forward, and with it every request in it)."""
    target = tiny_model(seed=0)
    for name, model in (("target", target), ("draft", noisy_copy(target, seed=1))):
        save_tiny_model(tmp_path / name, model)
        tokenizer = tiny_tokenizer()
        tokenizer.add_tokens(["<extra>"])
        tokenizer.save_pretrained(tmp_path / name)
    quant = "int8" if rowwise_int8_available() else "none"
    decoder = Decoder(
        str(tmp_path / "target"),
        str(tmp_path / "draft"),
        dtype="fp32",
        draft_confidence=0.0,
        lookup=False,
        target_quant=quant,
    )
    healthy = [text_body(prompt=p) for p in ("Hello there", "What is it", "Once upon")]
    poisoned = text_body(prompt="Hi <extra> there")
    with TestClient(create_app(decoder, ServerSettings(MODEL, max_queue=8, max_batch=4))) as http:
        solo = [http.post(TEXT, json=body).json()["choices"][0]["text"] for body in healthy]
        answers = concurrently(http, [poisoned, *healthy])
    assert answers[0].status_code == 400 and "'<extra>'" in answers[0].json()["error"]["message"]
    assert [a.status_code for a in answers[1:]] == [200] * 3
    assert [a.json()["choices"][0]["text"] for a in answers[1:]] == solo


def concurrently(http: TestClient, bodies: list[dict[str, Any]]) -> list[Any]:
    """``bodies`` posted at once, each from a thread of its own; their answers in order."""
    answers: dict[int, Any] = {}

    def send(i: int, body: dict[str, Any]) -> None:
        answers[i] = http.post(TEXT, json=body)

    threads = [threading.Thread(target=send, args=(i, b)) for i, b in enumerate(bodies)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return [answers[i] for i in range(len(bodies))]


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        (text_body(stop="end\ud800"), "stop", "surrogate"),
        (text_body(stop=["ok", "\udc00x"]), "stop.1", "surrogate"),
        (text_body(marspec={"timeout": 1e-9}), "marspec.timeout", ">= 0.1"),
        (text_body(max_tokens=250), "max_tokens", "at most"),  # the tiny model's context is 256 tokens
    ],
)
def test_a_request_that_cannot_be_served_is_400_naming_why(http, body, param, needle) -> None:
    # As JSON escapes ("\\ud800"): a lone surrogate has no UTF-8 form to send.
    answer = http.post(TEXT, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and needle in error["message"]


def test_prompt_and_max_tokens_beyond_the_context_is_400_as_openai_answers(http, decoder) -> None:
    context = decoder.target.context_length
    prompt = "ab" * ((context - 4) // 2)  # one token a character: room for 4 more
    room = context - len(decoder.tokenizer(prompt).input_ids)
    fits = http.post(TEXT, json=text_body(prompt=prompt, max_tokens=room))
    assert fits.status_code == 200, fits.text
    over = http.post(TEXT, json=text_body(prompt=prompt, max_tokens=room + 1))
    assert over.status_code == 400
    error = over.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert f"at most {room}" in error["message"]
    unset = http.post(
        TEXT, json={"model": MODEL, "prompt": prompt}
    )  # the server's default: cut at the context
    assert unset.status_code == 200


def test_head_on_health_answers_its_status_without_a_body(http) -> None:
    answer = http.head("/health")
    assert answer.status_code == 200 and answer.content == b""


def test_choices_cancelled_because_the_queue_refused_a_sibling_are_not_disconnects(decoder) -> None:
    app = create_app(decoder, ServerSettings(MODEL, max_queue=1, max_batch=1))
    with TestClient(app) as client:
        refused = client.post(TEXT, json=text_body(n=3, max_tokens=100, marspec={"rule": "plain"}))
        assert refused.status_code == 429
        wait_until(lambda: counter(client, "marspec_generations_total", outcome="cancelled_refused") == 2)
        assert counter(client, "marspec_generations_total", outcome="cancelled_disconnect") == 0


def wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s")
        time.sleep(0.02)


class LiveServer:
    """The app under uvicorn as ``marspec serve`` configures it, on a loopback socket from
    :func:`bind_socket`, in a thread."""

    def __init__(self, decoder, settings: ServerSettings | None = None) -> None:
        settings = settings or ServerSettings(MODEL, max_batch=1)
        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.app = create_app(decoder, settings)
        self.server = uvicorn.Server(uvicorn_config(self.app, settings, "warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive())
        assert self.server.started

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()


@pytest.fixture
def live(decoder, monkeypatch) -> Iterator[LiveServer]:
    monkeypatch.setattr(HeaderTimeoutProtocol, "header_timeout", 0.5)
    server = LiveServer(decoder)
    yield server
    server.stop()


def test_accepted_connections_send_without_nagles_delay(live: LiveServer) -> None:
    with socket.create_connection(("127.0.0.1", live.port), timeout=30) as client:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert client.recv(4096).startswith(b"HTTP/1.1 200")
        accepted = [conn.transport.get_extra_info("socket") for conn in live.server.server_state.connections]
        assert accepted and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in accepted)


def test_half_sent_headers_do_not_hold_a_connection(live: LiveServer) -> None:
    with socket.create_connection(("127.0.0.1", live.port), timeout=30) as client:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the blank line never comes
        assert client.recv(4096) == b""  # closed by the server (within the socket's 30 s, or it raises)
    with socket.create_connection(("127.0.0.1", live.port), timeout=30) as idle:  # sends nothing at all
        assert idle.recv(4096) == b""
    with socket.create_connection(("127.0.0.1", live.port), timeout=30) as slow:  # a whole request, slowly
        for piece in (b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
            slow.sendall(piece)
            time.sleep(0.1)
        assert slow.recv(4096).startswith(b"HTTP/1.1 200")


SOAK_PROMPTS = [
    {"prompt": "Hello there"},
    {"prompt": "Once upon a time", "temperature": 0.8, "seed": 3},
    {"prompt": "ab ab ab ab", "marspec": {"rule": "mars", "theta": 0.3}},
    {"prompt": "What is it", "max_tokens": 4},
    {"prompt": "count 1 2 3", "temperature": 0.7, "seed": 11, "marspec": {"rule": "plain"}},
]


def soak_request(url: str, body: dict[str, Any], mode: str) -> str | None:
    """One request: ``"whole"`` (one JSON answer), ``"stream"`` (the deltas joined, in order) or
    ``"hang_up"`` (streamed, the connection closed after the first chunk): its text, None for a hang-up."""
    with httpx.Client(base_url=url, timeout=120) as client:
        if mode == "whole":
            answer = client.post(TEXT, json=body)
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["text"]
        parts = []
        with client.stream("POST", TEXT, json={**body, "stream": True}) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    parts.append(json.loads(line[6:])["choices"][0]["text"])
                    if mode == "hang_up":
                        return None
        return "".join(parts)


# Tiny models, loopback only: ~5 s on a quiet 2-core machine (~1 minute on a loaded one).
def test_a_soak_of_200_requests_from_8_clients_with_hang_ups_loses_and_reorders_nothing(decoder) -> None:
    """200 requests over loopback from 8 clients at once (greedy, seeded sampling and MARS mixed, whole
    answers, streams, and streams hung up after their first chunk) into a server decoding 4 together:
    every answer that is read is its prompt's answer alone, each stream's deltas add up to it in order,
    every request ends in exactly one counted outcome and the server ends idle with nothing queued."""
    server = LiveServer(decoder, ServerSettings(MODEL, max_batch=4, max_queue=16))
    try:
        url = f"http://127.0.0.1:{server.port}"
        bodies = [text_body(**{"max_tokens": 6, **p}) for p in SOAK_PROMPTS]
        alone = [soak_request(url, body, "whole") for body in bodies]
        modes = ("whole", "stream", "whole", "stream", "hang_up")
        wrong: list[tuple[int, int, str | None]] = []

        def client(c: int) -> None:
            for j in range(25):
                which, mode = (c + j) % len(bodies), modes[j % len(modes)]
                text = soak_request(url, bodies[which], mode)
                if mode != "hang_up" and text != alone[which]:
                    wrong.append((c, j, text))

        clients = [threading.Thread(target=client, args=(c,)) for c in range(8)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(600)
        assert not wrong and not any(thread.is_alive() for thread in clients)
        engine = server.app.state.engine
        wait_until(lambda: not engine.busy and engine.queue_depth == 0)
        exposed = httpx.get(f"{url}/metrics", timeout=30).text
        ended = {
            sample.labels["outcome"]: sample.value
            for family in text_string_to_metric_families(exposed)
            for sample in family.samples
            if sample.name == "marspec_generations_total"
        }
        assert ended.get("completed", 0) + ended.get("cancelled_disconnect", 0) == 200 + len(bodies), ended
        assert sum(ended.values()) == 200 + len(bodies), ended  # nothing failed, timed out or refused
        assert ended["completed"] >= 160 + len(bodies) and engine._scheduler.peak >= 2
    finally:
        server.stop()
