"""The RAM a vLLM engine reserves on CPU, checked before it starts (vLLM's own refusal is a traceback)."""

from __future__ import annotations

import os

import psutil  # a dependency of vLLM, which measures free RAM with it too
import pytest


def ram_share(default: float) -> float:
    """vLLM's RAM reservation on CPU (``gpu_memory_utilization``), checked against the RAM free now.

    vLLM on CPU refuses to start an engine when less RAM is available than this share of the total, with
    an error deep in its start-up traceback. Another process holding RAM (a benchmark, another engine) is
    the usual cause on a shared machine, so say that in one line before any engine starts.
    """
    share = float(os.environ.get("MARSPEC_VLLM_MEMORY_SHARE", default))
    memory = psutil.virtual_memory()
    total, available = memory.total / 2**30, memory.available / 2**30
    if available < share * total:
        pytest.fail(
            f"vLLM's engines reserve {share} of the RAM ({share * total:.1f} GiB) and only "
            f"{available:.1f} GiB is free: stop the processes holding RAM, "
            f"or set MARSPEC_VLLM_MEMORY_SHARE lower",
            pytrace=False,
        )
    return share
