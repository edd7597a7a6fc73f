"""marspec's native CPU kernels as one library per kernel path: built on first use, loaded, and what
this process may call.

Each path's library (:mod:`.paths`) holds every operator (``q4k_linear``, ``q6k_linear``,
``attention_rows``, ``attention_segments``, ``vocab_argmax``, ``vocab_top2``, ``gguf_dequantize``,
``gguf_pack_tiles``, ``amx_available``, ``amx_set_min_rows``, ``path``) in a namespace of its own,
``torch.ops.marspec_<library>``, so that tests can load several paths' libraries in one process and
compare them bit for bit. The process's own path (:func:`~.paths.chosen_path`) is what the engines call,
through :func:`ops`.

Whether the kernels run here is decided once per process, with the reason when they do not
(:func:`unavailable_reason`): no path for this CPU, no compiler, a failed build (its first error line),
or a model cache that cannot be written.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from marspec.backends.kernels.paths import PATH_VARIABLE, CpuPath, chosen_path, path_named, runs
from marspec.errors import MarspecError, one_line

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "q4k.cpp",
        "q6k.cpp",
        "attention.cpp",
        "vocab.cpp",
        "amx.cpp",
        "layer.cpp",
        "dequant.cpp",
        "pack.cpp",
    )
)
# -ffp-contract=off: the compiler fuses no multiply-add the source does not spell, so every row runs the
# same float operations on every path. -fvisibility=hidden: each library keeps its own functions (the
# kernels' templates and torch's inline ones, compiled for its instruction set); exported, the dynamic
# linker would bind a second library's calls to the first one loaded (another path's code). -fopenmp
# (Linux): at::parallel_for is a header template that runs on one thread without it; the library then
# uses the OpenMP runtime torch has loaded.
_COMMON_FLAGS = (
    "-O3",
    "-ffp-contract=off",
    "-fvisibility=hidden",
    "-fvisibility-inlines-hidden",
    *(("-fopenmp",) if sys.platform.startswith("linux") else ()),
)

_LOADING = threading.Lock()  # one build and load per library and process, whichever threads ask at once


def build_flags(path: CpuPath) -> tuple[str, ...]:
    """The compiler flags of ``path``'s library."""
    return (*_COMMON_FLAGS, *path.flags, f"-D{path.isa_macro}", f"-DMARSPEC_OPS=marspec_{path.library}")


def library_ops(path: CpuPath) -> Any:
    """``path``'s operators (``torch.ops.marspec_<library>``), its library built (once, into marspec's
    cache) and loaded first if needed; a one-line :class:`MarspecError` with the reason if it cannot be."""
    with _LOADING:
        reason = _loaded(path.library, path)
    if reason is not None:
        raise MarspecError(reason)
    return getattr(torch.ops, f"marspec_{path.library}")


@functools.cache
def _loaded(library: str, path: CpuPath) -> str | None:
    """Build and load ``library`` (for ``path``); None, or why it cannot run here."""
    from marspec.backends.kernels.build import BuildError, load_library

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) to build marspec's kernels: install g++ or clang (or set CXX)"
    try:
        load_library(f"marspec_kernels_{library}", SOURCES, build_flags(path), label=f"{path.name} kernels")
    except BuildError as exc:
        return str(exc)
    except Exception as exc:  # a compile or load error of torch's extension machinery
        return f"building marspec's {path.name} kernels failed: {one_line(exc)}"
    return None


@functools.cache
def _process_path() -> tuple[CpuPath | None, str | None]:
    """This process's path and, where its kernels cannot run, why (decided once)."""
    path = chosen_path()
    if path is None:
        return None, (
            "no kernel path for this CPU (x86-64 needs AVX2 with FMA and F16C; ARM needs NEON with dot "
            "products)"
        )
    with _LOADING:
        reason = _loaded(path.library, path)
    if reason is None and path.name == "avx512_vnni" and runs(path_named("amx")):
        # One library serves both paths: where MARSPEC_CPU_PATH forces avx512_vnni on a CPU with AMX, its
        # calls never take the tiles.
        torch.ops.marspec_avx512_vnni.amx_set_min_rows(0, 0)
    return path, reason


def process_path() -> CpuPath | None:
    """The kernel path this process runs (None where none runs here); a one-line error if
    ``MARSPEC_CPU_PATH`` names a path this CPU does not run."""
    return _process_path()[0]


def kernels_available() -> bool:
    """Whether marspec's kernels (the q4k engine's Q4_K and Q6_K layers, row attention, the vocabulary's
    top two) run in this process: a path for this CPU, built and loaded."""
    return _process_path()[1] is None


def unavailable_reason() -> str | None:
    """Why the kernels do not run in this process (one line), or None where they do."""
    return _process_path()[1]


def ops() -> Any:
    """The operators of this process's path (``torch.ops.marspec_<library>``); a one-line error with the
    reason where the kernels do not run here."""
    path, reason = _process_path()
    if reason is not None or path is None:
        raise MarspecError(f"marspec's CPU kernels do not run here: {reason}")
    return getattr(torch.ops, f"marspec_{path.library}")


def build_id(path: CpuPath) -> str:
    """What ``path``'s library is built from (its sources, flags, torch and Python), as a short hash: what
    the kernels' speed depends on beside the CPU, so that costs measured with other kernels are not
    taken for these."""
    return _library_file(path).stem.rpartition("-")[2]


def _library_file(path: CpuPath) -> Path:
    """Where ``path``'s library is cached, built or not."""
    from marspec.backends.kernels.build import library_path

    return library_path(f"marspec_kernels_{path.library}", SOURCES, build_flags(path))


def library_loaded() -> bool:
    """Whether this process's kernels are loaded already (by a layer or row attention), without building
    or loading anything: for operators not worth a build of their own (the vocabulary's)."""
    return _process_path.cache_info().currsize > 0 and kernels_available()


def library_ready() -> bool:
    """Whether this process's kernels run here without a compile: loaded already, or built into the cache
    (loading takes milliseconds). For work the kernels only speed up (a conversion's dequantizing), which
    should never wait minutes for a build."""
    if library_loaded():
        return True
    try:
        path = chosen_path()
    except MarspecError:  # MARSPEC_CPU_PATH names a path this CPU lacks: process_path says so
        return False
    if path is None:
        return False
    return _library_file(path).is_file() and kernels_available()


def read_only_tensor(array: np.ndarray) -> torch.Tensor:
    """``array`` as a tensor sharing its memory, for an operator that only reads it: a GGUF's tensors are
    read-only views of the file, which torch would warn of on every one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        return torch.from_numpy(array)


def amx_available() -> bool:
    """Whether the Q4_K and Q6_K kernels take AMX tiles for many rows in this process: its path is
    ``amx``, and Linux lets it use the tiles."""
    path = process_path()
    return kernels_available() and path is not None and path.amx and bool(ops().amx_available())


@contextlib.contextmanager
def amx_from_rows(q4k: int, q6k: int | None = None) -> Iterator[None]:
    """Inside, the Q4_K kernel takes its AMX path (where :func:`amx_available`) for calls of at least
    ``q4k`` rows and the Q6_K kernel for calls of at least ``q6k`` (default: ``q4k``) rows, 0 never, in
    every thread; after, the settings before. Only speed depends on it: a row's output is the same bits
    on both paths. For tests and benchmarks."""
    before = ops().amx_set_min_rows(q4k, q4k if q6k is None else q6k)
    try:
        yield
    finally:
        ops().amx_set_min_rows(*before)


def describe() -> str:
    """One line for a user: the path this process runs and why, or why the kernels do not run."""
    try:
        path = process_path()
    except MarspecError as exc:
        return str(exc)
    reason = unavailable_reason()
    if reason is not None:
        return f"CPU kernels: none ({reason})"
    assert path is not None
    forced = f", forced by {PATH_VARIABLE}" if os.environ.get(PATH_VARIABLE, "").strip() else ""
    return f"CPU kernels: {path.name} ({path.speed}{forced})"
