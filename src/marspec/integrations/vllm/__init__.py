"""MARS inside vLLM: a general plugin that swaps vLLM's accept rule for marspec's.

Install ``marspec[vllm]`` next to vLLM; vLLM loads the plugin in every process through the entry point
group ``vllm.general_plugins``. It stays inert until a deployment asks for it::

    vllm serve TARGET --speculative-config '{"model": "DRAFT", "num_speculative_tokens": 5}' \\
        --additional-config '{"marspec": {"rule": "mars", "theta": 0.9, "margin": "logit_ratio"}}'

Offline: ``LLM(TARGET, speculative_config=..., additional_config={"marspec": {...}})``. Greedy requests
get the greedy MARS rule and sampled requests the MARS sampling rule, per request in mixed batches, for
every speculative method vLLM offers (draft model, n-gram, EAGLE, MTP): the plugin acts where vLLM
verifies, after any drafter. Counters of exact and relaxed accepts: :func:`read_counters` offline, and a
``marspec counters:`` log line in the engine process every ``log_every`` steps.

This package imports vLLM only in :mod:`.plugin`; the settings and the batched rule work without it.
"""

from marspec.integrations.vllm.batch_rule import AcceptCounters, accepted_drafts, relax_close_calls
from marspec.integrations.vllm.config import PluginConfig, VllmPluginConfigError, parse_plugin_config


def register() -> None:
    """vLLM's entry point (``vllm.general_plugins``); see :mod:`marspec.integrations.vllm.plugin`."""
    from marspec.integrations.vllm import plugin

    plugin.register()


def read_counters(llm: object) -> dict[str, float]:
    """Exact/relaxed accept counters of an offline ``vllm.LLM`` (see :func:`.plugin.read_counters`)."""
    from marspec.integrations.vllm import plugin

    return plugin.read_counters(llm)


def reset_counters(llm: object) -> None:
    """Zero the accept counters of an offline ``vllm.LLM``."""
    from marspec.integrations.vllm import plugin

    plugin.reset_counters(llm)


__all__ = [
    "AcceptCounters",
    "PluginConfig",
    "VllmPluginConfigError",
    "accepted_drafts",
    "parse_plugin_config",
    "read_counters",
    "register",
    "relax_close_calls",
    "reset_counters",
]
