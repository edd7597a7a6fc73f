"""The plugin's settings, read from vLLM's ``additional_config`` under the key ``"marspec"``.

Kept free of vLLM imports so the settings can be validated (and tested) anywhere.
"""

from __future__ import annotations

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
_KEYS = (*(key for key, _ in _RULE_FIELDS), "log_every")
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
    settings = additional_config[CONFIG_KEY]
    if not isinstance(settings, Mapping):
        raise VllmPluginConfigError(
            f'additional_config["{CONFIG_KEY}"] must be a JSON object such as '
            f'{{"rule": "mars", "theta": 0.9}}, got {type(settings).__name__} {settings!r}'
        )
    unknown = sorted(set(settings) - set(_KEYS))
    if unknown:
        raise VllmPluginConfigError(
            f'unknown key(s) {", ".join(map(repr, unknown))} in additional_config["{CONFIG_KEY}"]; '
            f"use: {', '.join(_KEYS)}"
        )
    # Settled as the library's options are (marspec.settings.settle_rule: absent keys take the same
    # defaults, a margin named without a theta its own usual threshold). One rule serves greedy and
    # sampled requests alike, so it is the greedy setting.
    rule_args = {field: settings[key] for key, field in _RULE_FIELDS if key in settings}
    try:
        rule = settle_rule(**rule_args)
    except MarspecError as exc:
        raise VllmPluginConfigError(f'additional_config["{CONFIG_KEY}"]: {exc}') from None
    log_every = settings.get("log_every", DEFAULT_LOG_EVERY)
    if not isinstance(log_every, numbers.Integral) or isinstance(log_every, bool) or log_every < 0:
        raise VllmPluginConfigError(
            f'additional_config["{CONFIG_KEY}"]["log_every"]={log_every!r} is invalid: use an integer >= 0 '
            f"(verification steps between two counter log lines; 0 turns them off)"
        )
    return PluginConfig(rule=rule, log_every=int(log_every))
