"""The hooks that put marspec's accept rule into vLLM. Imported only inside a process that has vLLM.

vLLM calls :func:`register` in every process it starts (entry-point group ``vllm.general_plugins``).
``register`` changes no behaviour by itself: it wraps two places so that a deployment configured with
``additional_config={"marspec": {...}}`` is (1) validated when its engine config is built, in the user's
process, and (2) switched to the MARS rule when the worker builds its rejection sampler. Without that
key every wrapper passes straight through.

What switching does, in the worker process only:
- vLLM's module-level ``rejection_sample`` (looked up at call time by ``RejectionSampler.forward``) is
  wrapped: the target logits are rewritten by :func:`~marspec.integrations.vllm.batch_rule.relax_close_calls`
  and handed to vLLM's own function, so greedy and sampled requests in one batch each get their rule;
- the counters of exact and relaxed accepts are updated, and logged every ``log_every`` steps;
- on the CPU platform, where vLLM registers a C++ override of the rejection sampler's expand kernel that
  writes into an int64 copy and never copies back (vLLM issue 55005: a batch mixing greedy and sampled
  requests then reads uninitialised temperatures), a pure-torch replacement is registered over it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from marspec.integrations.vllm.batch_rule import AcceptCounters, counts_from_cumulative, relax_close_calls
from marspec.integrations.vllm.config import PluginConfig, VllmPluginConfigError, parse_plugin_config

logger = logging.getLogger("vllm.marspec")  # a child of vLLM's logger, so it shares its handlers

_EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
_WRAPPED = "_marspec_wrapped"

# This process's state: the active settings (None: inert), the accept counters, vLLM's own function.
_active: PluginConfig | None = None
_original_rejection_sample: Any = None
_steps_since_log = 0
counters = AcceptCounters()


def register() -> None:
    """vLLM's plugin entry point. Idempotent: vLLM may call it several times per process."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.sample import rejection_sampler

    _wrap(EngineArgs, "create_engine_config", _checked_create_engine_config)
    _wrap(rejection_sampler.RejectionSampler, "__init__", _activating_init)


def _wrap(owner: type, name: str, make: Any) -> None:
    original = getattr(owner, name)
    if getattr(original, _WRAPPED, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _WRAPPED, True)
    setattr(owner, name, wrapper)


def _checked_create_engine_config(original: Any) -> Any:
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        settings = parse_plugin_config(self.additional_config)  # bad values fail here, before any load
        vllm_config = original(self, *args, **kwargs)
        if settings is not None:
            check_deployment(vllm_config)
        return vllm_config

    return create_engine_config


def check_deployment(vllm_config: Any) -> None:
    """Refuse a configured plugin on a deployment where it could not take effect."""
    spec = vllm_config.speculative_config
    if spec is None:
        raise VllmPluginConfigError(
            'additional_config["marspec"] is set but speculative decoding is not: MARS changes how draft '
            "tokens are verified, so also pass a speculative config, e.g. "
            '--speculative-config \'{"method": "ngram", "num_speculative_tokens": 4}\''
        )
    method = getattr(spec, "rejection_sample_method", "standard")
    if method != "standard":
        raise VllmPluginConfigError(
            f"speculative_config.rejection_sample_method={method!r} replaces vLLM's verification, which "
            'MARS builds on: use the default "standard", or drop additional_config["marspec"]'
        )
    if vllm_config.use_v2_model_runner:
        raise VllmPluginConfigError(
            "vLLM chose its V2 model runner, whose rejection sampler the marspec plugin does not hook; "
            "set VLLM_USE_V2_MODEL_RUNNER=0 to run MARS on the V1 runner"
        )


def _activating_init(original: Any) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        settings = parse_plugin_config(vllm_config.additional_config if vllm_config else None)
        if settings is not None:
            activate(settings)

    return __init__


def activate(settings: PluginConfig) -> None:
    """Verify with ``settings.rule`` from now on in this process (called by the worker at start-up)."""
    global _active, _original_rejection_sample
    from vllm.v1.sample import rejection_sampler

    _active = settings
    if _original_rejection_sample is None:
        _original_rejection_sample = rejection_sampler.rejection_sample
        rejection_sampler.rejection_sample = _mars_rejection_sample
    fixed = fix_cpu_expand_kernel()
    logger.info(
        "marspec: verifying with %s (theta=%s, margin=%s)%s",
        settings.rule.name,
        settings.rule.theta,
        settings.rule.margin,
        "; replaced vLLM's CPU expand kernel (issue 55005)" if fixed else "",
    )


def _mars_rejection_sample(
    draft_token_ids: torch.Tensor,  # [T]
    num_draft_tokens: list[int],  # [B]
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [T, V]
    target_logits: torch.Tensor,  # [T, V], processed (temperature, top-k/top-p) for sampled requests
    bonus_token_ids: torch.Tensor,  # [B, 1]
    sampling_metadata: Any,
    *args: Any,
    **kwargs: Any,  # newer vLLM versions add keyword arguments: pass them through
) -> torch.Tensor:
    global _steps_since_log
    assert _active is not None and _original_rejection_sample is not None
    batch = relax_close_calls(target_logits, draft_token_ids, _active.rule)
    output = _original_rejection_sample(
        draft_token_ids,
        num_draft_tokens,
        max_spec_len,
        cu_num_draft_tokens,
        draft_probs,
        batch.logits,
        bonus_token_ids,
        sampling_metadata,
        *args,
        **kwargs,
    )  # [B, max_spec_len + 1]
    counts = counts_from_cumulative(cu_num_draft_tokens)  # [B], already on the device: no copy from the list
    greedy_rows = None
    if not sampling_metadata.all_greedy:
        greedy_requests = sampling_metadata.temperature == 0  # vLLM's GREEDY_TEMPERATURE
        greedy_rows = torch.repeat_interleave(
            greedy_requests, counts, output_size=draft_token_ids.shape[0]
        )  # [T]
    counters.record(batch, output, counts, greedy_rows)
    _steps_since_log += 1
    if _active.log_every and _steps_since_log >= _active.log_every:
        _steps_since_log = 0
        logger.info("marspec counters: %s", format_counters(counters.snapshot()))
    return output


def format_counters(snapshot: dict[str, float]) -> str:
    """One log line: drafted, accepted exact/relaxed, relaxed share, mean accepted per step."""
    return (
        f"steps {snapshot['steps']}, drafted {snapshot['drafted']}, exact {snapshot['accepted_exact']}, "
        f"relaxed {snapshot['accepted_relaxed']} ({snapshot['relaxed_share']:.1%} of accepts), "
        f"mean accepted {snapshot['mean_accepted']:.2f} per step"
    )


def fix_cpu_expand_kernel() -> bool:
    """Replace vLLM's broken CPU expand-kernel override, only where it is the one registered."""
    from vllm.triton_utils import dispatcher
    from vllm.v1.sample import rejection_sampler

    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # not a CPU build
        return False
    broken = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    override = rejection_sampler.expand_kernel  # vLLM's KernelOverride once the CPU platform registered it
    if broken is None or getattr(override, "_impl", None) is not broken:
        return False
    # Swap the implementation inside vLLM's own override object, so every holder of it (the warmup
    # dispatcher keeps references) calls the fixed one; vLLM launches it with positional arguments.
    override._impl = override.func = expand_by_repeat_interleave
    override._forward_by_name = False
    original_kernel, _ = dispatcher._registry[_EXPAND_KERNEL]
    dispatcher._registry[_EXPAND_KERNEL] = (original_kernel, expand_by_repeat_interleave)
    return True


def expand_by_repeat_interleave(
    output: torch.Tensor,  # [T]
    values: torch.Tensor,  # [B]
    cu_num_tokens: torch.Tensor,  # [B]
    replace_from: Any,
    replace_to: Any,
    MAX_NUM_TOKENS: int | None = None,  # the kernel's own argument name, passed by vLLM
) -> None:
    """vLLM's expand kernel in torch: ``output[t] = values[request of t]``, ``replace_from -> replace_to``."""
    counts = counts_from_cumulative(cu_num_tokens)  # [B]
    replaced = torch.where(values == replace_from, torch.as_tensor(replace_to, dtype=values.dtype), values)
    output.copy_(torch.repeat_interleave(replaced, counts, output_size=output.shape[0]))


def read_counters(llm: Any) -> dict[str, float]:
    """The accept counters of an offline ``vllm.LLM``'s engine (``collective_rpc`` to its worker).

    With vLLM's engine in a separate process (the default), vLLM only ships a function to it when
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` is set; with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` it runs here.
    """
    return llm.collective_rpc(_worker_counters)[0]


def reset_counters(llm: Any) -> None:
    """Zero the accept counters of an offline ``vllm.LLM``'s engine (see :func:`read_counters`)."""
    llm.collective_rpc(_worker_reset)


def _worker_counters(_worker: Any = None) -> dict[str, float]:
    return counters.snapshot()


def _worker_reset(_worker: Any = None) -> None:
    counters.reset()
