"""The library API on a small real model (SmolLM2-135M-Instruct) with n-gram drafting."""

from __future__ import annotations

import re

import pytest
import torch

from marspec import Decoder, GenerationOptions, MarspecError, defaults
from marspec.defaults import MAX_K
from marspec.settings import settle

SMALL = "smollm2-135m-instruct"
PROMPT = "Repeat exactly: alpha beta gamma delta, alpha beta gamma delta, alpha beta gamma delta."


@pytest.fixture(scope="module")
def decoder() -> Decoder:
    return Decoder(SMALL, "ngram", dtype="fp32")


def test_stream_yields_the_text_and_keeps_the_result(decoder):
    stream = decoder.stream(PROMPT, rule="strict", k=4, max_new_tokens=24)
    pieces = list(stream)
    assert stream.result is not None
    assert "".join(pieces) == stream.result.text
    assert len(pieces) > 1  # it really streamed


def test_ngram_strict_equals_plain_and_saves_forwards(decoder):
    plain = decoder.generate(PROMPT, rule="plain", max_new_tokens=32)
    strict = decoder.generate(PROMPT, rule="strict", k=4, max_new_tokens=32)
    assert strict.token_ids == plain.token_ids
    assert strict.stats.target_forwards < plain.stats.target_forwards  # the prompt repeats: lookup hits


def test_chat_messages_and_raw_prompts(decoder):
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
    ]
    assert decoder.generate(messages, rule="plain", max_new_tokens=8).token_ids
    raw = decoder.generate("The capital of France is", rule="plain", chat=False, max_new_tokens=4)
    assert raw.token_ids


def test_sampling_without_a_seed_leaves_torch_global_rng_alone(decoder):
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    decoder.generate(PROMPT, rule="strict", temperature=0.8, max_new_tokens=4)
    assert torch.equal(torch.rand(1), expected)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"speed": 3}, "unknown generation option"),
        ({"rule": "greedy"}, "unknown rule"),
        ({"rule": "mars", "theta": 1.01}, "theta"),
        ({"k": 0}, "k (draft length)"),
        ({"k": MAX_K + 1}, f"k (draft length) must be an integer in [1, {MAX_K}], got {MAX_K + 1}"),
        ({"k": 2**63 - 1}, f"in [1, {MAX_K}]"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": "hot"}, "temperature must be a finite number"),
        ({"rule": "mars", "margin": "kl"}, "unknown margin"),
        ({"rule": "mars", "margin": "logit_gap", "theta": -1.0}, "logit_gap"),
        ({"theta": 0.9}, "no rule is named"),
        ({"margin": "logit_ratio"}, "no rule is named"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop": [""]}, "stop strings"),
        ({"seed": 2**64}, "seed"),
        ({"seed": "7"}, "seed"),
    ],
)
def test_bad_options(decoder, kwargs, needle):
    with pytest.raises(MarspecError, match=re.escape(needle)):
        decoder.generate(PROMPT, **kwargs)


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [
        ("", "empty prompt"),
        ([], "empty prompt"),
        ([{"role": "user"}], "content"),
        ([{"content": "x"}], "role"),
        (42, "string or a list"),
        # A lone UTF-16 surrogate is not text a tokenizer can read: refused, naming where it is.
        ("ab\ud800", "the prompt contains a lone UTF-16 surrogate (U+D800 at character 2)"),
        ([{"role": "user", "content": "\udfff"}], "chat message 0's content contains a lone UTF-16"),
    ],
)
def test_bad_prompts(decoder, prompt, needle):
    with pytest.raises(MarspecError, match=re.escape(needle)):
        decoder.generate(prompt, rule="plain", max_new_tokens=2)


def test_speculative_rule_without_a_drafter_is_refused():
    plain_only = Decoder(SMALL, None, dtype="fp32")
    with pytest.raises(MarspecError, match="needs a drafter"):
        plain_only.generate(PROMPT, rule="mars")


def test_options_are_checked_when_built_not_when_generating():
    with pytest.raises(MarspecError, match="stop strings"):
        GenerationOptions(stop=["ok", ""])
    with pytest.raises(MarspecError, match="seed"):
        GenerationOptions(seed=-(2**63) - 1)


def test_no_rule_named_is_strict_and_a_lossy_setting_without_a_rule_is_refused():
    from marspec.defaults import DEFAULT_RULE

    assert DEFAULT_RULE == "strict"
    options = GenerationOptions()
    assert options.rule == "strict" and settle(options).rule.name == "strict"
    assert GenerationOptions(temperature=1.0).rule == "strict"
    assert GenerationOptions.of({"k": 4}).rule == "strict"
    for lossy in ({"theta": 0.9}, {"margin": "logit_ratio"}, {"theta": "auto"}):
        with pytest.raises(MarspecError, match=r"no rule is named.*rule='mars'"):
            GenerationOptions.of(lossy)
        assert GenerationOptions.of({"rule": "mars", **lossy}).rule == "mars"
    # A named lossless rule keeps ignoring a theta (the demo passes one theta to every row).
    assert settle(GenerationOptions(rule="strict", theta=0.9)).rule.name == "strict"


def test_unset_margin_and_theta_take_the_measured_default_of_the_decoding_regime(monkeypatch):
    from marspec import defaults
    from marspec.rules import Rule

    def rule(**options) -> Rule:
        return settle(GenerationOptions(rule="mars", **options)).rule

    greedy = Rule("mars", defaults.DEFAULT_THETA, defaults.DEFAULT_MARGIN)
    assert rule() == greedy
    assert rule(temperature=1.0) == Rule("mars", defaults.SAMPLING_THETA, defaults.SAMPLING_MARGIN)
    # A margin named alone takes its usual threshold: 0.5 on z2/z1 would relax nearly every step.
    assert rule(margin="logit_ratio") == Rule("mars", 0.9, "logit_ratio")
    assert rule(margin="logit_gap").theta == pytest.approx(0.693, abs=1e-3)
    assert rule(theta=0.8) == Rule("mars", 0.8, defaults.DEFAULT_MARGIN)  # a theta alone: the default margin
    # The regime decides, read when the options are turned into a rule (so a server's defaults, built
    # once, follow each request's temperature): shown with a sampling default that differs.
    monkeypatch.setattr(defaults, "SAMPLING_MARGIN", "logit_ratio")
    monkeypatch.setattr(defaults, "SAMPLING_THETA", 0.95)
    server_defaults = GenerationOptions(rule="mars", k=4)
    assert settle(server_defaults).rule == greedy
    sampled = GenerationOptions(**{**server_defaults.__dict__, "temperature": 0.7})
    assert settle(sampled).rule == Rule("mars", 0.95, "logit_ratio")
    assert rule(temperature=0.7, margin="logit_ratio") == Rule("mars", 0.95, "logit_ratio")
    assert rule(temperature=0.7, margin="prob_ratio") == Rule("mars", 0.5, "prob_ratio")
    assert rule(temperature=0.7, theta=0.9) == Rule("mars", 0.9, "logit_ratio")
    # A rival's parameter has no default.
    with pytest.raises(MarspecError, match="rule 'topk' needs theta: use an integer k >= 1"):
        GenerationOptions(rule="topk")


def test_the_decoder_echoes_the_setting_it_decodes_with(decoder):
    resolved = decoder.resolve_theta(GenerationOptions(temperature=1.0))
    assert (resolved.margin, resolved.theta) == (defaults.SAMPLING_MARGIN, defaults.SAMPLING_THETA)
    auto_strict = decoder.resolve_theta(GenerationOptions(rule="strict", theta="auto"))
    assert auto_strict.theta == 1.0 and auto_strict.margin is not None  # nothing left unset
