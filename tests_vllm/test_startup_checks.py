"""Bad plugin settings are refused when the engine config is built: before any model loads."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm import LLM

from marspec.integrations.vllm import VllmPluginConfigError

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"theta": 1.5}, "theta"),
        ({"rule": "lenient"}, "rule"),
        ({"margin": "vibes"}, "margin"),
        ({"log_every": -1}, "log_every"),
        ({"thteta": 0.9}, "thteta"),
        ("mars", "JSON object"),
    ],
)
def test_bad_values_are_refused_at_startup(target_dir: str, settings: object, named: str) -> None:
    with pytest.raises(VllmPluginConfigError, match=named):
        LLM(model=target_dir, speculative_config=NGRAM, additional_config={"marspec": settings})


def test_plugin_without_speculative_decoding_is_refused(target_dir: str) -> None:
    with pytest.raises(VllmPluginConfigError, match="speculative"):
        LLM(model=target_dir, additional_config={"marspec": {"theta": 0.9}})
