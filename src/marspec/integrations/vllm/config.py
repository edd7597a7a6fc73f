"""The plugin's settings, read from vLLM's ``additional_config`` under the key ``"marspec"``.

Kept free of vLLM imports so the settings can be validated (and tested) anywhere.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from marspec.errors import MarspecError
from marspec.rules import Rule
from marspec.settings import settle_rule

CONFIG_KEY = "marspec"
# config key -> settle_rule argument ("window": FLy's deferral window; refused for the other rules)
_RULE_FIELDS = (("rule", "rule"), ("theta", "theta"), ("margin", "margin"), ("window", "window"))
_REQUEST_KEYS = tuple(key for key, _ in _RULE_FIELDS)  # a request's object: its rule only
_KEYS = (*_REQUEST_KEYS, "log_every")
DEFAULT_LOG_EVERY = 500  # verification steps between two counter log lines in the engine process


class VllmPluginConfigError(MarspecError):
    """``additional_config["marspec"]`` holds a value the plugin cannot use."""


@dataclass(frozen=True)
class PluginConfig:
    """What the plugin does once configured: the accept rule, and how often it logs its counters."""

    rule: Rule
    log_every: int = DEFAULT_LOG_EVERY  # 0 turns the periodic log line off


def parse_plugin_config(additional_config: Any) -> PluginConfig | None:
    """The plugin's settings from a vLLM ``additional_config``, or None when marspec is not configured.

    ``{"marspec": {"rule": "mars", "theta": 0.9, "margin": "logit_ratio", "log_every": 500}}`` (FLy:
    ``{"rule": "fly", "theta": 0.3, "window": 6}``); every key is optional and settles as a library
    option does (no rule named is strict, as everywhere; ``{"rule": "mars"}`` is MARS with its
    defaults). Raises
    :class:`VllmPluginConfigError` naming the bad value and what to use instead.
    """
    if not isinstance(additional_config, Mapping) or CONFIG_KEY not in additional_config:
        return None
    where = f'additional_config["{CONFIG_KEY}"]'
    settings = additional_config[CONFIG_KEY]
    rule = _rule(settings, where, _KEYS)
    log_every = settings.get("log_every", DEFAULT_LOG_EVERY)
    if not isinstance(log_every, numbers.Integral) or isinstance(log_every, bool) or log_every < 0:
        raise VllmPluginConfigError(
            f'{where}["log_every"]={log_every!r} is invalid: use an integer >= 0 '
            f"(verification steps between two counter log lines; 0 turns them off)"
        )
    return PluginConfig(rule=rule, log_every=int(log_every))


def parse_request_rule(extra_args: Any, num_speculative_tokens: int | None = None) -> Rule | None:
    """The rule one request asks for in ``SamplingParams.extra_args["marspec"]``, or None (the deployment's).

    The object takes the keys of the deployment's (``rule``, ``theta``, ``margin``, ``window``; not
    ``log_every``) with the same meaning: it stands alone, absent keys taking the rule's defaults, as in
    ``additional_config["marspec"]``. It may also be that object as a JSON string (``vllm serve`` passes
    ``vllm_xargs`` values only as strings and numbers). With ``num_speculative_tokens``, a FLy window
    that could never relax is refused too. Raises :class:`VllmPluginConfigError` in one line.
    """
    if not isinstance(extra_args, Mapping) or CONFIG_KEY not in extra_args:
        return None
    where = f'extra_args["{CONFIG_KEY}"]'
    settings = extra_args[CONFIG_KEY]
    if isinstance(settings, str):
        try:
            settings = json.loads(settings)
        except ValueError:
            raise VllmPluginConfigError(
                f"{where}={settings!r} is not JSON: use an object such as "
                '{"rule": "mars", "theta": 0.9}, or that object as a JSON string'
            ) from None
    rule = _rule(settings, where, _REQUEST_KEYS)
    if num_speculative_tokens is not None:
        problem = fly_window_problem(rule, num_speculative_tokens)
        if problem:
            raise VllmPluginConfigError(f"{where}: {problem}")
    return rule


def fly_window_problem(rule: Rule, num_speculative_tokens: int) -> str | None:
    """Why ``rule`` could never relax with ``num_speculative_tokens`` drafts per step, or None.

    FLy defers a mismatch only with ``window`` draft tokens after it in the same step."""
    k = num_speculative_tokens
    if not (rule.family.takes_window and rule.relaxes and rule.window is not None and rule.window >= k):
        return None
    fix = f"use a window of at most {k - 1}, or more speculative tokens"
    if k < 2:
        fix = "use num_speculative_tokens >= 2"
    return (
        f"FLy's window={rule.window} needs that many draft tokens after a mismatch, and "
        f"num_speculative_tokens={k} never leaves them, so it could never relax: {fix}"
    )


def _rule(settings: Any, where: str, keys: tuple[str, ...]) -> Rule:
    """The :class:`Rule` a settings object describes; its keys must be among ``keys``."""
    if not isinstance(settings, Mapping):
        raise VllmPluginConfigError(
            f'{where} must be a JSON object such as {{"rule": "mars", "theta": 0.9}}, '
            f"got {type(settings).__name__} {settings!r}"
        )
    unknown = sorted(set(settings) - set(keys))
    if unknown:
        raise VllmPluginConfigError(
            f"unknown key(s) {', '.join(map(repr, unknown))} in {where}; use: {', '.join(keys)}"
        )
    # Settled as the library's options are (marspec.settings.settle_rule: absent keys take the same
    # defaults, a margin named without a theta its own usual threshold). One rule serves greedy and
    # sampled requests alike, so it is the greedy setting.
    rule_args = {field: settings[key] for key, field in _RULE_FIELDS if key in settings}
    try:
        rule = settle_rule(**rule_args)
    except MarspecError as exc:
        raise VllmPluginConfigError(f"{where}: {exc}") from None
    problem = _unfit(rule)
    if problem:
        raise VllmPluginConfigError(f"{where}: {problem}")
    return rule


def _unfit(rule: Rule) -> str | None:
    """Why the plugin's forcing scheme (a row rewritten one-hot at the draft token where the rule
    accepts; vLLM's own verifier does the rest) cannot carry ``rule``, or None: docs/vllm.md, "Rules the
    plugin refuses"."""
    if rule.family.judges_block:
        return (
            f"rule {rule.name!r} judges a block with its own random draws, which vLLM makes inside its "
            "verifier; vLLM has block verification itself: speculative_config "
            "rejection_sample_method='block', without the plugin"
        )
    if rule.family.needs_draft_probs:
        return (
            f"rule {rule.name!r} mixes the drafter's distribution into the target's, and vLLM's verifier "
            "gets none by default (draft_sample_method='greedy': q one-hot, against which the mixture "
            "accepts any draft with probability >= 1 - theta); use marspec's own decoder (Decoder, "
            "marspec serve)"
        )
    return None
