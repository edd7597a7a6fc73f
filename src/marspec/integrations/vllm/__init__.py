"""MARS inside vLLM: a general plugin that swaps vLLM's accept rule for marspec's.

Install marspec in vLLM's environment; vLLM loads the plugin in every process through the entry point
group ``vllm.general_plugins``. It stays inert until a deployment asks for it::

    vllm serve TARGET --speculative-config '{"model": "DRAFT", "num_speculative_tokens": 5}' \\
        --additional-config '{"marspec": {"rule": "mars", "theta": 0.9, "margin": "logit_ratio"}}'

Offline: ``LLM(TARGET, speculative_config=..., additional_config={"marspec": {...}})``. Greedy requests
get the greedy MARS rule and sampled requests the MARS sampling rule, per request in mixed batches, for
every speculative method vLLM offers (draft model, n-gram, EAGLE/EAGLE-3, MTP): the plugin acts where
vLLM verifies, after any drafter, on both of vLLM's model runners (V1 and V2). The vLLM releases it
was tested on are :data:`SUPPORTED_VLLM_VERSIONS`; on any vLLM it checks the signature of the verifier
it wraps and refuses one it does not know (:class:`VllmVersionError`). See docs/vllm.md.

A request may pick its own rule, ``SamplingParams(extra_args={"marspec": {...}})``, validated when vLLM
admits it (:mod:`.request_rules`); the deployment's stays the default.

Counters of exact and relaxed accepts, per rule: in ``vllm serve``'s Prometheus ``/metrics``
(:mod:`.metrics`, through a vLLM stat logger plugin), :func:`read_counters` and
:func:`read_counters_by_rule` offline, and a ``marspec counters:`` log line in the engine process every
``log_every`` steps.

vLLM is imported only inside functions (:mod:`.plugin`'s and :mod:`.cpu_expand`'s), so this package
imports (and its settings and batched rule work) without vLLM.
"""

from marspec.integrations.vllm.batch_rule import AcceptCounters, accepted_drafts, decide, forced, v2_layout
from marspec.integrations.vllm.config import (
    PluginConfig,
    VllmPluginConfigError,
    parse_plugin_config,
    parse_request_rule,
)
from marspec.integrations.vllm.plugin import read_counters, read_counters_by_rule, register, reset_counters
from marspec.integrations.vllm.versions import SUPPORTED_VLLM_VERSIONS, VllmVersionError

__all__ = [
    "SUPPORTED_VLLM_VERSIONS",
    "AcceptCounters",
    "PluginConfig",
    "VllmPluginConfigError",
    "VllmVersionError",
    "accepted_drafts",
    "decide",
    "forced",
    "parse_plugin_config",
    "parse_request_rule",
    "read_counters",
    "read_counters_by_rule",
    "register",
    "reset_counters",
    "v2_layout",
]
