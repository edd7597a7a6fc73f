"""Devices: names resolve or are refused with the fix; the loop keeps everything on the target's device."""

from __future__ import annotations

import pytest
import torch
from conftest import SMALL
from typer.testing import CliRunner

from marspec import Decoder, MarspecError
from marspec.cli import app
from marspec.devices import resolve_device

HAS_CUDA = torch.cuda.is_available()


def test_cpu_and_auto_resolve() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    expected = "cuda" if HAS_CUDA else "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device("auto").type == expected


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "cpu:1", "", "gpu"])
def test_unknown_devices_are_refused(name: str) -> None:
    with pytest.raises(MarspecError, match="unknown device"):
        resolve_device(name)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_names_the_fix() -> None:
    with pytest.raises(MarspecError, match=r"sees no CUDA GPU.*--device cpu"):
        resolve_device("cuda")


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA GPU")
@pytest.mark.parametrize(("device", "needle"), [("cuda", "no CUDA GPU"), ("quantum", "unknown device")])
def test_cli_bad_device_is_one_line_and_exit_2(device: str, needle: str) -> None:
    result = CliRunner().invoke(
        app, ["generate", "hi", "--target", SMALL, "--draft", "ngram", "--device", device]
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]


def _plain_strict_and_sampled_on(device: str):
    """Decode one prompt with plain, strict (greedy) and strict (sampled) on ``device``."""
    decoder = Decoder(SMALL, SMALL, dtype="fp32", device=device)
    prompt = "List three prime numbers and explain why each is prime."
    plain = decoder.generate(prompt, rule="plain", max_new_tokens=32)
    strict = decoder.generate(prompt, rule="strict", k=4, max_new_tokens=32)
    sampled = decoder.generate(prompt, rule="strict", k=4, max_new_tokens=16, temperature=0.8, seed=3)
    return decoder, plain, strict, sampled


def test_an_explicit_cpu_device_runs_the_loop_exactly() -> None:
    decoder, plain, strict, sampled = _plain_strict_and_sampled_on("cpu")
    assert decoder.target.device.type == "cpu"
    assert strict.token_ids == plain.token_ids and strict.stats.target_forwards < plain.stats.target_forwards
    assert sampled.stats.new_tokens > 0


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU on this machine (the project's machines have none)")
def test_the_loop_runs_exactly_on_cuda() -> None:
    decoder, plain, strict, sampled = _plain_strict_and_sampled_on("cuda")
    assert decoder.target.device.type == "cuda"
    assert strict.token_ids == plain.token_ids and strict.stats.target_forwards < plain.stats.target_forwards
    assert sampled.stats.new_tokens > 0
