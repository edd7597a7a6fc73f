"""The CPU kernel paths: which instruction sets marspec's native kernels are built for, which of them this
CPU runs, and which one a process uses.

Every path computes the same bits for the same inputs (the kernels are written once over ``simd.h``'s
operations, each path implementing them exactly), so the path only changes speed. The best path this CPU
runs is taken, unless ``MARSPEC_CPU_PATH`` names another (any path the CPU runs: how tests compare them on
one machine). The CPU's features come from the operating system's own report (Linux's /proc/cpuinfo,
macOS's sysctl), else from torch's (:func:`torch.backends.cpu.get_cpu_capability`).
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from marspec.errors import MarspecError

PATH_VARIABLE = "MARSPEC_CPU_PATH"


@dataclass(frozen=True)
class CpuPath:
    """One kernel path: its ``name``, the ``library`` build it runs on (AMX rides on the AVX-512 build),
    the ``machine`` architecture, the CPU ``features`` it needs (Linux's names), the compiler flags and
    the source macro of its build, and a few words a user reads (``speed``)."""

    name: str
    library: str
    machine: str
    features: tuple[str, ...]
    isa_macro: str
    flags: tuple[str, ...]
    speed: str

    @property
    def amx(self) -> bool:
        """Whether calls of many rows take AMX tiles on this path."""
        return self.name == "amx"


_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
_AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c")
_AVX512_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c")

# Best first: a process takes the first one its CPU runs.
PATHS: tuple[CpuPath, ...] = (
    CpuPath(
        "amx",
        "avx512_vnni",
        "x86_64",
        (*_AVX512_FEATURES, "amx_tile", "amx_int8"),
        "MARSPEC_ISA_AVX512",
        _AVX512_FLAGS,
        "AVX-512 VNNI, AMX tiles for many rows",
    ),
    CpuPath(
        "avx512_vnni",
        "avx512_vnni",
        "x86_64",
        _AVX512_FEATURES,
        "MARSPEC_ISA_AVX512",
        _AVX512_FLAGS,
        "AVX-512 VNNI",
    ),
    CpuPath(
        "avx_vnni",
        "avx_vnni",
        "x86_64",
        ("avx2", "fma", "f16c", "avx_vnni"),
        "MARSPEC_ISA_AVX2",
        (*_AVX2_FLAGS, "-mavxvnni", "-DMARSPEC_AVX_VNNI"),
        "AVX-VNNI (256-bit)",
    ),
    CpuPath("avx2", "avx2", "x86_64", ("avx2", "fma", "f16c"), "MARSPEC_ISA_AVX2", _AVX2_FLAGS, "AVX2"),
    CpuPath(
        "neon",
        "neon",
        "aarch64",
        ("asimd", "asimddp"),
        "MARSPEC_ISA_NEON",
        ("-march=armv8.2-a+dotprod",),
        "NEON with dot products",
    ),
)
PATH_NAMES = tuple(path.name for path in PATHS)


def path_named(name: str) -> CpuPath:
    """The path called ``name`` (a one-line error naming the paths otherwise)."""
    for path in PATHS:
        if path.name == name:
            return path
    raise MarspecError(f"{name!r} is not a kernel path: choose one of {', '.join(PATH_NAMES)}")


def machine() -> str:
    """This machine's architecture as the paths name it: "x86_64", "aarch64", or what the OS says."""
    name = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name, name)


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's features, in Linux's names: the OS's report (Linux's /proc/cpuinfo flags, macOS's
    sysctl), else what torch's own detection implies."""
    reported = _linux_features() if sys.platform.startswith("linux") else _macos_features()
    return reported if reported is not None else _torch_features()


def _linux_features() -> frozenset[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, ARM
            return frozenset(value.split())
    return None


# macOS's sysctl names for the features the paths need.
_MACOS_SYSCTL = {
    "hw.optional.arm.FEAT_DotProd": ("asimd", "asimddp"),
    "hw.optional.avx2_0": ("avx2",),
    "hw.optional.fma": ("fma", "f16c"),
    "hw.optional.avx512f": ("avx512f",),
    "hw.optional.avx512bw": ("avx512bw",),
    "hw.optional.avx512vl": ("avx512vl",),
    "hw.optional.avx512vnni": ("avx512_vnni",),
}


def _macos_features() -> frozenset[str] | None:
    if sys.platform != "darwin":
        return None
    found: set[str] = set()
    for key, features in _MACOS_SYSCTL.items():
        try:
            out = subprocess.run(
                ["sysctl", "-n", key], capture_output=True, text=True, timeout=5, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        if out.stdout.strip() == "1":
            found.update(features)
    return frozenset(found)


def _torch_features() -> frozenset[str]:
    """What torch's CPU capability implies (it does not report VNNI: such a CPU gets the AVX2 path)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        return frozenset(("avx2", "fma", "f16c"))
    if machine() == "aarch64":
        return frozenset(("asimd",))  # dot products unknown
    return frozenset()


def runs(path: CpuPath, features: frozenset[str] | None = None) -> bool:
    """Whether this CPU (or one with ``features``) runs ``path``."""
    features = cpu_features() if features is None else features
    return path.machine == machine() and all(feature in features for feature in path.features)


def runnable_paths() -> tuple[CpuPath, ...]:
    """The paths this CPU runs, best first."""
    return tuple(path for path in PATHS if runs(path))


def chosen_path() -> CpuPath | None:
    """The path this process uses: ``MARSPEC_CPU_PATH``'s where it is set (a one-line error if this CPU
    does not run it), else the best this CPU runs; None where it runs none."""
    forced = os.environ.get(PATH_VARIABLE, "").strip()
    runnable = runnable_paths()
    if not forced:
        return runnable[0] if runnable else None
    path = path_named(forced) if forced in PATH_NAMES else None
    here = ", ".join(p.name for p in runnable) or "none"
    if path is None:
        raise MarspecError(
            f"{PATH_VARIABLE}={forced!r} is not a kernel path: choose one of {', '.join(PATH_NAMES)} "
            f"(this CPU runs: {here})"
        )
    if path not in runnable:
        missing = sorted(set(path.features) - cpu_features()) if path.machine == machine() else [path.machine]
        raise MarspecError(
            f"{PATH_VARIABLE}={forced!r} needs {', '.join(missing)}, which this CPU lacks: "
            f"this CPU runs {here} (unset {PATH_VARIABLE} to take the best)"
        )
    return path
