"""Bad plugin settings, and a vLLM whose verifier the plugin does not know, are refused when the engine
config is built: before any model loads."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest

pytest.importorskip("vllm")

import vllm
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.sample import rejection_sampler

from marspec.integrations.vllm import VllmPluginConfigError, VllmVersionError, plugin
from marspec.integrations.vllm.config import PluginConfig
from marspec.integrations.vllm.hooks import WRAPPED, unwrapped
from marspec.integrations.vllm.request_rules import check_request
from marspec.integrations.vllm.versions import V1_VERIFIER, V2_VERIFIER, check_verifier
from marspec.rules import Rule

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"rule": "mars", "theta": 1.5}, "theta"),
        ({"rule": "lenient"}, "rule"),
        ({"rule": "mars", "margin": "vibes"}, "margin"),
        ({"log_every": -1}, "log_every"),
        ({"thteta": 0.9}, "thteta"),
        ("mars", "JSON object"),
        ({"rule": "mars", "window": 2}, "window"),  # FLy's parameter
        # FLy could never defer: 4 draft tokens never leave 4 after a mismatch.
        ({"rule": "fly", "window": 4}, "window=4 .*num_speculative_tokens=4.*at most 3"),
    ],
)
def test_bad_values_are_refused_at_startup(target_dir: str, settings: object, named: str) -> None:
    with pytest.raises(VllmPluginConfigError, match=named):
        LLM(model=target_dir, speculative_config=NGRAM, additional_config={"marspec": settings})


def test_vllms_own_verification_methods_are_refused_by_name(target_dir: str) -> None:
    """Block verification replaces the accept test the plugin builds on (vLLM 0.33's "fly" likewise;
    see tests/test_vllm_contracts.py): refused in one line naming it."""
    spec = {**NGRAM, "rejection_sample_method": "block"}
    with pytest.raises(VllmPluginConfigError, match="'block' is block verification") as refused:
        LLM(model=target_dir, speculative_config=spec, additional_config={"marspec": {}})
    assert "\n" not in str(refused.value)


def test_a_request_is_checked_against_its_deployment(target_dir: str) -> None:
    """Admission (vLLM's request validation, wrapped once an engine config is built): a bad per-request
    rule is refused in one line, and so is any per-request rule where the plugin is not configured."""
    with_plugin = EngineArgs(
        model=target_dir, speculative_config=NGRAM, additional_config={"marspec": {}}
    ).create_engine_config()
    assert getattr(InputProcessor._validate_params, WRAPPED, False)
    check_request(SamplingParams(extra_args={"marspec": {"rule": "strict"}}), with_plugin)
    check_request(SamplingParams(), with_plugin)
    with pytest.raises(VllmPluginConfigError, match=r"window=4.*num_speculative_tokens=4"):
        check_request(SamplingParams(extra_args={"marspec": {"rule": "fly", "window": 4}}), with_plugin)
    without = EngineArgs(model=target_dir, speculative_config=NGRAM).create_engine_config()
    with pytest.raises(VllmPluginConfigError, match="runs without the marspec plugin"):
        check_request(SamplingParams(extra_args={"marspec": {}}), without)


def test_plugin_without_speculative_decoding_is_refused(target_dir: str) -> None:
    with pytest.raises(VllmPluginConfigError, match="speculative"):
        LLM(model=target_dir, additional_config={"marspec": {"rule": "mars", "theta": 0.9}})


def earlier_vllm_verifier(
    draft_token_ids,
    num_draft_tokens,
    max_spec_len,
    cu_num_draft_tokens,
    draft_probs,
    target_probs,
    bonus_token_ids,
    sampling_metadata,
):
    """The V1 verifier's signature in earlier vLLM: probabilities where v0.32 passes logits."""
    raise AssertionError("a verifier the plugin refused must never be called")


def unknown_verifier(logits, draft_token_ids, metadata):
    """A verifier signature the plugin has never seen."""
    raise AssertionError("a verifier the plugin refused must never be called")


def test_this_vllms_verifiers_have_the_signatures_the_plugin_knows() -> None:
    for contract in (V1_VERIFIER, V2_VERIFIER):
        function = getattr(importlib.import_module(contract.module), contract.name)
        check_verifier(unwrapped(function), contract, vllm.__version__)


@pytest.mark.parametrize(
    ("verifier", "named"), [(earlier_vllm_verifier, "target_probs"), (unknown_verifier, "logits")]
)
def test_an_unknown_verifier_signature_is_refused_in_one_line(
    target_dir: str, verifier: Callable[..., object], named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rejection_sampler, "rejection_sample", verifier)
    # At engine start in the user's process (before any model loads)...
    with pytest.raises(VllmVersionError) as refused:
        LLM(model=target_dir, speculative_config=NGRAM, additional_config={"marspec": {}})
    message = str(refused.value)
    assert "\n" not in message and f"vLLM {vllm.__version__}" in message and named in message
    # ...and in the worker, when it would wrap the verifier.
    with pytest.raises(VllmVersionError, match=f"vLLM {vllm.__version__}"):
        plugin.activate(PluginConfig(Rule(), log_every=0), V1_VERIFIER)
