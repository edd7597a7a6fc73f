"""The hooks that put marspec's accept rule into vLLM. Imported only inside a process that has vLLM.

vLLM calls :func:`register` in every process it starts (entry-point group ``vllm.general_plugins``).
``register`` changes no behaviour by itself: it wraps a few places so that a deployment configured with
``additional_config={"marspec": {...}}`` is (1) validated when its engine config is built, in the user's
process, and (2) switched to the marspec rule when the worker builds its rejection sampler. Without that
key every wrapper passes straight through.

vLLM has two model runners, each with its own verifier, both hooked (see :mod:`.versions`):
- V1 (``vllm.v1.sample.rejection_sampler``; the runner vLLM uses on CPU): its module-level
  ``rejection_sample``, looked up at call time by ``RejectionSampler.forward``;
- V2 (``vllm.v1.worker.gpu.spec_decode.rejection_sampler``; vLLM's default on GPUs with Triton): the
  ``rejection_sample`` that ``RejectionSampler._verify`` calls, a global of that module.

What switching does, in the worker process only:
- the verifier's signature is checked against the one the plugin knows (one-line refusal otherwise);
- the verifier is wrapped: the rows where the rule accepts a close call are forced in the target's
  logits (:func:`~marspec.integrations.vllm.batch_rule.forced`) while vLLM's own function verifies, so
  greedy and sampled requests in one batch each get their rule;
- the counters of exact and relaxed accepts are updated, and logged every ``log_every`` steps;
- on the V1 runner on CPU, where vLLM installs a C++ override of the rejection sampler's expand kernel
  that writes into an int64 copy and never copies back (vLLM issue 55005: a batch mixing greedy and
  sampled requests then reads uninitialised temperatures), a pure-torch replacement is installed over
  it at the first verification, only when the installed override fails a probe
  (:func:`~marspec.integrations.vllm.cpu_expand.fix_cpu_expand_kernel`).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from marspec.integrations.vllm import request_rules
from marspec.integrations.vllm.batch_rule import (
    AcceptCounters,
    Decisions,
    accepted_lengths,
    counts_from_cumulative,
    decide_each,
    forced,
    v2_layout,
)
from marspec.integrations.vllm.config import (
    PluginConfig,
    VllmPluginConfigError,
    fly_window_problem,
    parse_plugin_config,
)
from marspec.integrations.vllm.cpu_expand import fix_cpu_expand_kernel
from marspec.integrations.vllm.hooks import WRAPPED, unwrapped, wrap
from marspec.integrations.vllm.metrics import METRICS_DIR_VARIABLE, CounterFile, prepare_metrics_dir
from marspec.integrations.vllm.versions import (
    REFUSED_REJECTION_METHODS,
    SIGNATURE_CHECKED_VLLM_VERSIONS,
    SUPPORTED_VLLM_VERSIONS,
    V1_VERIFIER,
    V2_VERIFIER,
    VerifierContract,
    check_verifier,
    is_signature_checked_version,
    is_tested_version,
)

logger = logging.getLogger("vllm.marspec")  # a child of vLLM's logger, so it shares its handlers

# vLLM's workers (module, class): the last step before serving is their compile_or_warm_up_model.
_WORKERS = (("vllm.v1.worker.gpu_worker", "Worker"), ("vllm.v1.worker.cpu_worker", "CPUWorker"))

# This process's state: the active settings (None: inert) and the accept counters.
_active: PluginConfig | None = None
_expand_checked = False  # whether the CPU expand kernel was probed (at the first V1 verification)
_steps_since_log = 0
counters = AcceptCounters()
_counter_file: CounterFile | None = None  # where this worker publishes the counters (None: nowhere)


def register() -> None:
    """vLLM's plugin entry point. Idempotent: vLLM may call it several times per process."""
    from vllm.engine.arg_utils import EngineArgs

    wrap(EngineArgs, "create_engine_config", _checked_create_engine_config)
    for contract in (V1_VERIFIER, V2_VERIFIER):
        try:
            module = importlib.import_module(contract.module)
        except ImportError:  # a vLLM without this runner: nothing of it to hook
            continue
        wrap(module.RejectionSampler, "__init__", functools.partial(_activating_init, contract=contract))


def vllm_version() -> str:
    """The installed vLLM's version string (``vllm.__version__``)."""
    import vllm

    return str(vllm.__version__)


def _checked_create_engine_config(original: Any) -> Any:
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        settings = parse_plugin_config(self.additional_config)  # bad values fail here, before any load
        vllm_config = original(self, *args, **kwargs)
        request_rules.hook_admission()  # also refuses a request's rule where the plugin is off
        if settings is not None:
            check_deployment(vllm_config, settings)
            prepare_metrics_dir()  # before vLLM starts its engine processes, which inherit it
        return vllm_config

    return create_engine_config


def runner_contract(vllm_config: Any) -> VerifierContract:
    """The verifier the deployment's model runner will call."""
    return V2_VERIFIER if getattr(vllm_config, "use_v2_model_runner", False) else V1_VERIFIER


def check_deployment(vllm_config: Any, settings: PluginConfig) -> None:
    """Refuse a configured plugin on a deployment where it could not take effect (or ``settings``' rule
    could not), or on a vLLM whose verifier it does not know (the worker checks again when it wraps it)."""
    spec = vllm_config.speculative_config
    if spec is None:
        raise VllmPluginConfigError(
            'additional_config["marspec"] is set but speculative decoding is not: MARS changes how draft '
            "tokens are verified, so also pass a speculative config, e.g. "
            '--speculative-config \'{"method": "ngram", "num_speculative_tokens": 4}\''
        )
    method = getattr(spec, "rejection_sample_method", "standard")
    if method != "standard":
        why = REFUSED_REJECTION_METHODS.get(method, "replaces the verification MARS builds on")
        raise VllmPluginConfigError(
            f"speculative_config.rejection_sample_method={method!r} {why}: the marspec plugin needs the "
            'default "standard" method; use it, or drop additional_config["marspec"] to keep '
            f"{method!r}"
        )
    problem = fly_window_problem(settings.rule, spec.num_speculative_tokens)
    if problem:
        raise VllmPluginConfigError(f'additional_config["marspec"]: {problem}')
    contract = runner_contract(vllm_config)
    module = importlib.import_module(contract.module)
    check_verifier(unwrapped(getattr(module, contract.name)), contract, vllm_version())


def _activating_init(original: Any, contract: VerifierContract) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        settings = parse_plugin_config(vllm_config.additional_config if vllm_config else None)
        if settings is not None:
            activate(settings, contract)

    return __init__


def activate(settings: PluginConfig, contract: VerifierContract = V1_VERIFIER) -> None:
    """Verify with ``settings.rule`` from now on in this process, on ``contract``'s runner (called by the
    worker when it builds its rejection sampler). Raises :class:`~.versions.VllmVersionError` when the
    installed vLLM's verifier is not the one the plugin knows."""
    global _active
    module = importlib.import_module(contract.module)
    current = getattr(module, contract.name)
    if not getattr(current, WRAPPED, False):
        version = vllm_version()
        check_verifier(current, contract, version)
        if is_signature_checked_version(version):
            logger.warning(
                "marspec: vLLM %s was checked against its published source (%s), not run by the "
                "plugin's tests (those ran on %s)",
                version,
                ", ".join(SIGNATURE_CHECKED_VLLM_VERSIONS),
                ", ".join(SUPPORTED_VLLM_VERSIONS),
            )
        elif not is_tested_version(version):
            logger.warning(
                "marspec: vLLM %s is not among the releases the plugin was tested on (%s); its %s verifier "
                "has the signature the plugin knows, so it runs",
                version,
                ", ".join(SUPPORTED_VLLM_VERSIONS),
                contract.runner,
            )
        make = _v1_verifier if contract is V1_VERIFIER else _v2_verifier
        wrapper = make(current)
        setattr(wrapper, WRAPPED, True)
        setattr(module, contract.name, wrapper)
    request_rules.hook_worker()
    for module_name, worker in _WORKERS:
        module = sys.modules.get(module_name)  # the worker running this is imported already
        if module is not None:
            wrap(getattr(module, worker), "compile_or_warm_up_model", _counting_from_here)
    global _counter_file
    _counter_file = _worker_counter_file()
    _active = settings
    rule = settings.rule
    # FLy reads no margin; its window is its second parameter.
    parameter = f"window={rule.window}" if rule.family.takes_window else f"margin={rule.margin}"
    logger.info(
        "marspec: verifying with %s (theta=%s, %s) on vLLM's %s runner",
        rule.name,
        rule.theta,
        parameter,
        contract.runner,
    )
    if rule.family.row_refusal and rule.relaxes:
        logger.warning(
            "marspec: FLy defers mismatches of greedy requests only; sampled requests are verified "
            "strictly (lossless), since FLy's sampled test needs the random draws vLLM makes inside its "
            "verifier"
        )


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], contract: VerifierContract, name: str) -> Any:
    """A verifier argument by name, whether vLLM passed it by position or by keyword."""
    index = contract.index(name)
    return args[index] if index < len(args) else kwargs[name]


def _v1_verifier(original: Callable[..., Any]) -> Callable[..., Any]:
    from vllm.v1.sample.rejection_sampler import GREEDY_TEMPERATURE

    @functools.wraps(original)
    def rejection_sample(*args: Any, **kwargs: Any) -> torch.Tensor:
        global _expand_checked
        assert _active is not None
        if not _expand_checked:  # at the first step: by then the CPU runner has installed its overrides
            _expand_checked = True
            if fix_cpu_expand_kernel():
                logger.info(
                    "marspec: replaced vLLM's CPU expand kernel, which loses its output (issue 55005)"
                )
        draft = _argument(args, kwargs, V1_VERIFIER, "draft_token_ids")  # [T]
        cu_num_draft_tokens = _argument(args, kwargs, V1_VERIFIER, "cu_num_draft_tokens")  # [B]
        logits = _argument(args, kwargs, V1_VERIFIER, "target_logits")  # [T, V], processed
        metadata = _argument(args, kwargs, V1_VERIFIER, "sampling_metadata")
        counts = counts_from_cumulative(cu_num_draft_tokens)  # [B], on the device: no copy from the list
        greedy_rows = None
        if not metadata.all_greedy:
            greedy_requests = metadata.temperature == GREEDY_TEMPERATURE  # [B]
            greedy_rows = torch.repeat_interleave(greedy_requests, counts, output_size=draft.shape[0])
        table = request_rules.v1_table(_active.rule, counts.shape[0], logits.device)
        row_rule = None
        if table.of_request is not None:
            row_rule = torch.repeat_interleave(table.of_request, counts, output_size=draft.shape[0])
        decisions = decide_each(logits, draft, table, row_rule, lengths=counts, greedy=greedy_rows)
        with forced(logits, decisions.relaxed, draft):
            output = original(*args, **kwargs)  # [B, max_spec_len + 1], -1 after the last token
        _count(decisions, accepted_lengths(output), counts, greedy_rows, table.names, table.name_of_request())
        return output

    return rejection_sample


def _v2_verifier(original: Callable[..., Any]) -> Callable[..., Any]:
    # V2's kernels test ``temperature == 0.0`` for greedy: the value V1 names GREEDY_TEMPERATURE.
    from vllm.v1.sample.rejection_sampler import GREEDY_TEMPERATURE

    @functools.wraps(original)
    def rejection_sample(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert _active is not None
        logits = _argument(args, kwargs, V2_VERIFIER, "target_logits")  # [L, V], processed
        layout = v2_layout(
            _argument(args, kwargs, V2_VERIFIER, "draft_sampled"),  # [L]
            _argument(args, kwargs, V2_VERIFIER, "cu_num_logits"),  # [R + 1]
            _argument(args, kwargs, V2_VERIFIER, "expanded_idx_mapping"),  # [L]
            _argument(args, kwargs, V2_VERIFIER, "temperature"),  # [max_num_reqs]
            GREEDY_TEMPERATURE,
        )
        # Rules are recorded per request-state slot (V2 indexes its per-request tensors by slot).
        slots = _argument(args, kwargs, V2_VERIFIER, "temperature").shape[0]
        table = request_rules.v2_table(_active.rule, slots, logits.device)
        row_rule = name_of_request = None
        if table.of_request is not None:
            row_rule = table.of_request[_argument(args, kwargs, V2_VERIFIER, "expanded_idx_mapping").long()]
            name_of_slot = table.name_of_request()
            assert name_of_slot is not None
            name_of_request = name_of_slot[_argument(args, kwargs, V2_VERIFIER, "idx_mapping").long()]
        decisions = decide_each(
            logits, layout.draft_tokens, table, row_rule, layout.rows, layout.num_logits, layout.greedy
        )
        with forced(logits, decisions.relaxed, layout.draft_tokens):
            sampled, num_sampled = original(*args, **kwargs)  # [R, S + 1], [R]: accepted + 1
        rows = layout.rows
        _count(
            Decisions(decisions.relaxed[rows], decisions.exact[rows]),
            num_sampled.long() - 1,
            layout.num_draft_tokens,
            layout.greedy[rows],
            table.names,
            name_of_request,
        )
        return sampled, num_sampled

    return rejection_sample


def _count(
    decisions: Decisions,
    n_accepted: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    greedy_rows: Any,
    names: tuple[str, ...],
    name_of_request: torch.Tensor | None,
) -> None:
    global _steps_since_log
    assert _active is not None
    counters.record(decisions, n_accepted, num_draft_tokens, greedy_rows, names, name_of_request)
    if _counter_file is not None:
        _counter_file.write(counters.by_rule())
    _steps_since_log += 1
    if _active.log_every and _steps_since_log >= _active.log_every:
        _steps_since_log = 0
        logger.info("marspec counters: %s", format_counters(counters.snapshot()))


def _counting_from_here(original: Any) -> Any:
    # vLLM's profiling and warm-up run the verifier on dummy batches before the engine serves (not
    # counted by vLLM's own metrics either): the counters start once the last of them is done.
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        counters.reset()
        if _counter_file is not None:
            _counter_file.write({})
        return result

    return compile_or_warm_up_model


def _worker_counter_file() -> CounterFile | None:
    """Where this worker publishes its counters for ``vllm serve``'s metrics (:mod:`.metrics`): only
    tensor-parallel rank 0, since every rank verifies the same batch; None without a metrics directory
    (an engine built outside the plugin's config hook)."""
    directory = os.environ.get(METRICS_DIR_VARIABLE)
    if not directory:
        return None
    from vllm.distributed import parallel_state

    if (
        parallel_state.model_parallel_is_initialized()
        and parallel_state.get_tensor_model_parallel_rank() != 0
    ):
        return None
    return CounterFile(directory)


def format_counters(snapshot: dict[str, float]) -> str:
    """One log line: drafted, accepted exact/relaxed, relaxed share, mean accepted per step."""
    return (
        f"steps {snapshot['steps']}, drafted {snapshot['drafted']}, exact {snapshot['accepted_exact']}, "
        f"relaxed {snapshot['accepted_relaxed']} ({snapshot['relaxed_share']:.1%} of accepts), "
        f"mean accepted {snapshot['mean_accepted']:.2f} per step"
    )


def read_counters(llm: Any) -> dict[str, float]:
    """The accept counters of an offline ``vllm.LLM``'s engine (``collective_rpc`` to its worker).

    With vLLM's engine in a separate process (the default), vLLM only ships a function to it when
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` is set; with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` it runs here.
    """
    return llm.collective_rpc(_worker_counters)[0]


def read_counters_by_rule(llm: Any) -> dict[str, dict[str, int]]:
    """The accept counters of an offline ``vllm.LLM``'s engine per rule name (see :func:`read_counters`)."""
    return llm.collective_rpc(_worker_counters_by_rule)[0]


def reset_counters(llm: Any) -> None:
    """Zero the accept counters of an offline ``vllm.LLM``'s engine (see :func:`read_counters`)."""
    llm.collective_rpc(_worker_reset)


def _worker_counters(_worker: Any = None) -> dict[str, float]:
    return counters.snapshot()


def _worker_counters_by_rule(_worker: Any = None) -> dict[str, dict[str, int]]:
    return counters.by_rule()


def _worker_reset(_worker: Any = None) -> None:
    counters.reset()
