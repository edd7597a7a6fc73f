"""A workaround for vLLM's CPU expand kernel (vLLM issue 55005), installed by the plugin when needed.

On the V1 runner on CPU vLLM installs a C++ override of the rejection sampler's expand kernel that
writes into an int64 copy of its output and never copies back, so a batch mixing greedy and sampled
requests reads uninitialised temperatures. :func:`fix_cpu_expand_kernel` probes the installed expand
and, only where it answers wrong, installs :func:`expand_by_repeat_interleave` in its place. It is a
repair of vLLM's CPU path, apart from the accept rule: :mod:`.plugin` calls it once, at the first V1
verification (when the CPU runner has installed its overrides). vLLM is imported only inside its
functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from marspec.integrations.vllm.batch_rule import counts_from_cumulative

_EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def fix_cpu_expand_kernel() -> bool:
    """Replace vLLM's CPU expand-kernel override where it is installed and broken; True if replaced.

    Only on a vLLM without Triton (where CPU overrides stand in for the Triton kernels): the installed
    expand is probed on a three-request batch, and only a wrong answer (vLLM issue 55005) installs
    :func:`expand_by_repeat_interleave` the way that vLLM installs its own CPU overrides: through its
    public kernel registry where it has one (v0.32: ``register_kernels``, which rebinds every holder of
    the kernel and logs that it overwrites vLLM's registration), else (v0.28, whose CPU runner assigns
    the module attribute) by assigning that same attribute.
    """
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:  # vLLM's Triton kernel runs: there is no CPU override to fix
        return False
    from vllm.v1.sample import rejection_sampler

    if _expands_correctly(rejection_sampler.expand_batch_to_tokens):
        return False
    try:
        from vllm.triton_utils.dispatcher import register_kernels
    except ImportError:
        rejection_sampler.expand_kernel = _Launcher(expand_by_repeat_interleave)
    else:
        try:
            register_kernels({_EXPAND_KERNEL: expand_by_repeat_interleave})
        except (AttributeError, TypeError):
            _redirect_installed_override(rejection_sampler.expand_kernel, expand_by_repeat_interleave)
    return _expands_correctly(rejection_sampler.expand_batch_to_tokens)


def _redirect_installed_override(installed: Any, function: Callable[..., Any]) -> None:
    """Point vLLM's installed CPU override object at ``function``.

    ``register_kernels`` rebinds a kernel's holders by scanning every loaded module, and v0.32's scan
    stops at an object whose ``__dict__`` is not a dict (found in ``vllm serve``'s worker, not offline).
    Every holder of the expand kernel holds the one override object vLLM's CPU platform registered at
    start-up, so routing that object's launches to ``function`` reaches them all; the probe that follows
    checks it."""
    installed._impl = function
    installed._forward_by_name = tuple(inspect.signature(function).parameters) == tuple(installed.arg_names)


class _Launcher:
    """``kernel[grid](*args)`` launches ``function(*args)``: a Triton kernel's calling form on CPU."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return self.function


def _expands_correctly(expand_batch_to_tokens: Callable[..., torch.Tensor]) -> bool:
    """Whether vLLM's ``expand_batch_to_tokens`` gives each request's temperature to its draft tokens."""
    temperatures = torch.tensor([0.0, 0.3125, 2.5])  # [B]: 0 (greedy) becomes 1
    cu_num_tokens = torch.tensor([2, 2, 5], dtype=torch.int32)  # [B]: 2, 0 and 3 tokens
    expanded = expand_batch_to_tokens(temperatures, cu_num_tokens, 5, replace_from=0, replace_to=1)  # [5]
    return expanded.tolist() == [1.0, 1.0, 2.5, 2.5, 2.5]


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
