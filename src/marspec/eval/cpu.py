"""Which processor a benchmark ran on: kernels round near-ties differently across CPU generations (so a
lossy rule's outputs differ) and speed ratios between CPUs are not measurements, so each record names it.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.cache
def cpu_name() -> str:
    """The processor, as precisely as the kernel names it: model name and, on x86, family, model and
    stepping (e.g. "AMD EPYC (family 26, model 2, stepping 1)"), or the platform's best guess."""
    guess = platform.processor() or platform.machine()
    try:
        return cpu_from_cpuinfo(Path("/proc/cpuinfo").read_text()) or guess
    except OSError:
        return guess


def cpu_from_cpuinfo(text: str) -> str | None:
    """The first processor of a /proc/cpuinfo listing, or None when it names none. Cloud machines often
    report a bare "AMD EPYC" or "Intel Xeon Processor" for several generations whose kernels round
    differently (a lossy rule's outputs then differ), so the generation's numbers are part of the name."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block ends here
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name")
    if name is None:
        return None
    labels = {"cpu family": "family", "model": "model", "stepping": "stepping"}
    generation = ", ".join(f"{label} {fields[key]}" for key, label in labels.items() if key in fields)
    return f"{name} ({generation})" if generation else name
