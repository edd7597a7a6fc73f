"""Per-request rules: ``SamplingParams(extra_args={"marspec": {...}})`` picks a request's rule in a batch.

A request without the key gets the deployment's rule (``additional_config["marspec"]``). Three places:

- **Admission** (the user's or API server's process): vLLM validates each request's parameters in
  ``InputProcessor._validate_params``; the plugin's wrapper checks the request's object there with
  :func:`~.config.parse_request_rule` (marspec's own :class:`~marspec.rules.Rule` validation, as for
  the deployment's object) and refuses a bad one in one line as vLLM's ``VLLMValidationError`` (a 400
  from ``vllm serve``), before the request reaches the engine. A request asking for a rule from a
  deployment without the plugin is refused there too, rather than silently verified as vLLM's.
- **V1 runner** (the worker): its verifier sees the batch only as tensors, so the wrapper of
  ``GPUModelRunner._sample`` reads the rule of each request of the batch being verified, in the
  batch's order (``input_batch.req_ids``), for the verifier wrapper to use (:func:`v1_table`).
- **V2 runner** (the worker): requests live in request-state slots, which the verifier's arguments
  index (``expanded_idx_mapping``, ``idx_mapping``); the wrapper of ``SamplingStates.add_request``
  records the rule of each slot's request as it arrives (:func:`v2_table`).

Imports vLLM inside its functions only.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
from collections.abc import Mapping
from typing import Any

import torch

from marspec.integrations.vllm.batch_rule import RuleTable
from marspec.integrations.vllm.config import (
    CONFIG_KEY,
    VllmPluginConfigError,
    parse_plugin_config,
    parse_request_rule,
)
from marspec.integrations.vllm.hooks import wrap
from marspec.rules import Rule

_INPUT_PROCESSOR = "vllm.v1.engine.input_processor"
_V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
_V2_SAMPLING_STATES = "vllm.v1.worker.gpu.sample.states"

# V1: the rules of the batch being sampled, in its request order (None: outside a sampling step, e.g.
# vLLM's warm-up calls of the verifier, which then use the deployment's rule).
_batch: list[Rule | None] | None = None
# V2: request-state slot -> the rule its request asked for (slots whose request asked for none: absent).
_slots: dict[int, Rule] = {}


def hook_admission() -> None:
    """Validate each request's ``extra_args["marspec"]`` where vLLM validates its parameters."""
    module = importlib.import_module(_INPUT_PROCESSOR)
    wrap(module.InputProcessor, "_validate_params", _validating)


def hook_worker() -> None:
    """Record each request's rule for the verifier, on whichever runner this worker has."""
    runner = sys.modules.get(_V1_RUNNER)  # imported already where the V1 runner builds its verifier
    if runner is not None:
        wrap(runner.GPUModelRunner, "_sample", _sampling)
    try:
        states = importlib.import_module(_V2_SAMPLING_STATES)
    except ImportError:  # a vLLM without the V2 runner
        return
    wrap(states.SamplingStates, "add_request", _adding)


def check_request(params: Any, vllm_config: Any) -> None:
    """Refuse, in one line, a request whose ``extra_args["marspec"]`` this deployment cannot honour."""
    extra_args = getattr(params, "extra_args", None)
    if not isinstance(extra_args, Mapping) or CONFIG_KEY not in extra_args:
        return
    if parse_plugin_config(vllm_config.additional_config) is None:
        raise VllmPluginConfigError(
            f'extra_args["{CONFIG_KEY}"] asks for a marspec rule, but this deployment runs without the '
            f"marspec plugin: start vLLM with --additional-config '{{\"{CONFIG_KEY}\": {{}}}}' and a "
            f'speculative config, or drop extra_args["{CONFIG_KEY}"]'
        )
    spec = vllm_config.speculative_config
    parse_request_rule(extra_args, spec.num_speculative_tokens if spec is not None else None)


def _validating(original: Any) -> Any:
    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, params, *args, **kwargs)
        try:
            check_request(params, self.vllm_config)
        except VllmPluginConfigError as exc:
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(str(exc), parameter=f"extra_args.{CONFIG_KEY}") from None
        return result

    return _validate_params


def request_rule(params: Any) -> Rule | None:
    """The rule a (validated) request asked for, or None for the deployment's."""
    extra_args = getattr(params, "extra_args", None)
    if not isinstance(extra_args, Mapping) or CONFIG_KEY not in extra_args:
        return None
    settings = extra_args[CONFIG_KEY]
    return _parsed(settings if isinstance(settings, str) else json.dumps(settings, sort_keys=True))


@functools.lru_cache(maxsize=256)
def _parsed(settings: str) -> Rule | None:
    # Requests repeat a handful of settings: parse each once per process.
    return parse_request_rule({CONFIG_KEY: settings})


def _sampling(original: Any) -> Any:
    def _sample(self: Any, logits: Any, spec_decode_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        global _batch
        if spec_decode_metadata is None:  # no verification in this step
            return original(self, logits, spec_decode_metadata, *args, **kwargs)
        _batch = [request_rule(self.requests[req_id].sampling_params) for req_id in self.input_batch.req_ids]
        try:
            return original(self, logits, spec_decode_metadata, *args, **kwargs)
        finally:
            _batch = None

    return _sample


def _adding(original: Any) -> Any:
    def add_request(self: Any, req_idx: int, sampling_params: Any, *args: Any, **kwargs: Any) -> Any:
        rule = request_rule(sampling_params)
        if rule is None:
            _slots.pop(req_idx, None)
        else:
            _slots[req_idx] = rule
        return original(self, req_idx, sampling_params, *args, **kwargs)

    return add_request


def v1_table(default: Rule, num_requests: int, device: torch.device) -> RuleTable:
    """The rules of the V1 batch being verified, per request (its order)."""
    if _batch is None:
        return RuleTable((default,))
    if len(_batch) != num_requests:
        raise RuntimeError(
            f"marspec: vLLM's batch holds {len(_batch)} requests but its verifier got {num_requests}; "
            "this vLLM orders its batch in a way the plugin does not know"
        )
    return RuleTable.build(default, _batch, device)


def v2_table(default: Rule, num_slots: int, device: torch.device) -> RuleTable:
    """The rules of V2's request-state slots, per slot (``num_slots``: the slot count, ``max_num_reqs``)."""
    if not _slots:
        return RuleTable((default,))
    return RuleTable.build(default, [_slots.get(slot) for slot in range(num_slots)], device)
