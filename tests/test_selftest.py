"""``marspec selftest``: it passes on the CPU, and each of its checks reports a real failure as one."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import marspec.decode
import marspec.selftest.equality as equality
import marspec.selftest.sampling as sampling
from marspec.backends.int8 import rowwise_int8_available
from marspec.backends.kernels import kernels_available
from marspec.cli import app
from marspec.drafters.model import ModelDrafter
from marspec.errors import MarspecError
from marspec.rules import Rule
from marspec.selftest import (
    Check,
    chi_square,
    compare_runs,
    first_difference,
    no_relax_equals_strict,
    one_read_per_step,
    reads_per_step,
    run_selftest,
    sampled_counts,
    target_joint,
    tiny_decoder,
)

runner = CliRunner()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: on a busy machine more threads only wait for each other (the selftest itself runs
    its CPU checks on one thread and puts the count back)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory, one_thread):
    return tiny_decoder(tmp_path_factory.mktemp("selftest"), torch.device("cpu"))


def test_selftest_passes_on_the_cpu_and_restores_the_thread_count():
    torch.set_num_threads(2)
    report = run_selftest("cpu")
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    assert report.device == "cpu" and report.passed, report.checks
    assert [c.name for c in report.checks] == [
        "strict == plain (greedy, chain and tree)",
        "rules that cannot relax == strict",
        "speculative sampling is lossless",
        "one device read per step",
        "fixed shapes == eager",
        *(["int8 engine: strict == plain, no-relax rules == strict"] if rowwise_int8_available() else []),
        *(["q4k engine: strict == plain, no-relax rules == strict"] if kernels_available() else []),
        "batch: each sequence decodes as it does alone",
        "fixed-shape batch: each sequence decodes as it does alone",
    ]
    for key in ("python", "torch", "transformers", "device", "attention (SDPA)", "CPU kernels"):
        assert report.environment[key] and not report.environment[key].startswith("unknown"), key
    assert report.to_dict()["passed"] is True


def test_comparison_reports_the_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2
    failed = compare_runs("strict == plain", [("same", [4, 5], [4, 5]), ("other", [1, 2, 3], [1, 2, 9])])
    assert failed == Check("strict == plain", False, "other: token 2 is 9, expected 3")
    shorter = compare_runs("x", [("cut", [1, 2, 3], [1, 2])])
    assert not shorter.passed and shorter.detail == "cut: token 2 is end, expected 3"
    assert compare_runs("x", [("a", [1], [1]), ("b", [2, 3], [2, 3])]).passed


class TemperatureOneDrafter(ModelDrafter):
    """A broken drafter: it samples at the run's temperature but reports q at temperature 1."""

    def propose(self, context, k, temperature, generator, alternatives=0):
        draft = super().propose(context, k, temperature, generator, alternatives)
        wrong = torch.softmax(draft.probs.clamp_min(1e-30).log() * temperature, dim=-1)
        return type(draft)(tokens=draft.tokens, probs=wrong, alternatives=draft.alternatives)


def test_the_sampling_check_catches_a_drafter_that_misreports_q():
    from marspec.backends.hf import HFCausalLM

    target = HFCausalLM(sampling.small_model(seed=0, sharpen=1.0), None, "small-target")
    draft = HFCausalLM(sampling.small_model(seed=1, sharpen=3.0), None, "small-draft")
    prompt = torch.tensor([1, 3, 0, 2])
    probs = target_joint(target, prompt)
    counts = sampled_counts(target, TemperatureOneDrafter(draft, sampling.SAMPLING_VOCAB), prompt, 800)
    assert chi_square(counts, probs) > sampling.CHI2_999_15


def test_the_no_relax_check_fails_when_a_rule_relaxes(decoder, monkeypatch):
    assert no_relax_equals_strict(decoder).passed
    relaxing = (("mars 0", {"rule": "mars", "theta": 0.0, "margin": "prob_ratio"}),)
    monkeypatch.setattr(equality, "NO_RELAX", relaxing)
    check = no_relax_equals_strict(decoder)
    assert not check.passed and ", mars 0: token " in check.detail, check


def test_the_read_check_fails_when_a_step_reads_the_device_twice(decoder, monkeypatch):
    verify_greedy = marspec.decode.verify_greedy

    def reads_a_logit_first(logits, draft_tokens, rule, *args):
        int(logits[0].argmax())  # a second host read of the target's logits
        return verify_greedy(logits, draft_tokens, rule, *args)

    assert one_read_per_step(decoder).passed
    monkeypatch.setattr(marspec.decode, "verify_greedy", reads_a_logit_first)
    check = one_read_per_step(decoder)
    assert not check.passed and check.detail.startswith("strict: step 1 read it 2 times"), check


def test_the_read_check_sees_the_drafts_confidence_stop(decoder, monkeypatch):
    """The draft's confidence stop reads each drafted token's probability: a read per drafted token
    beyond the verification's."""
    prompt = decoder.tokenizer("def f(x):", return_tensors="pt")["input_ids"][0]
    options = {"rule": Rule(), "k": 3, "max_new_tokens": 12, "reuse_prefix": False}
    assert set(reads_per_step(decoder, prompt, **options)) == {1}
    monkeypatch.setattr(decoder.drafter, "min_confidence", 1e-9)  # reads, but never stops a draft
    assert set(reads_per_step(decoder, prompt, **options)) - {1}


def test_cli_selftest_reports_a_failed_check_with_exit_1(tmp_path, monkeypatch):
    monkeypatch.setattr(sampling, "CHI2_999_15", 0.0)  # no sample can pass: the sampling check must fail
    out = runner.invoke(app, ["selftest", "--device", "cpu", "--json", str(tmp_path / "report.json")])
    assert out.exit_code == 1, out.output
    assert "FAIL" in out.output and "not run here" in out.output and "environment" in out.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] is False
    verdicts = {check["name"]: check["passed"] for check in report["checks"]}
    assert verdicts.pop("speculative sampling is lossless") is False
    assert all(verdicts.values()), verdicts


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_selftest_on_cuda_without_one_is_a_one_line_error():
    out = runner.invoke(app, ["selftest", "--device", "cuda"])
    assert out.exit_code == 2
    lines = [line for line in out.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "CUDA" in lines[0], out.output
    with pytest.raises(MarspecError, match="CUDA"):
        run_selftest("cuda")
