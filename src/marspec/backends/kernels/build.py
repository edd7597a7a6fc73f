"""Compile a C++ torch operator library once per set of sources, torch and flags, and load it.

The library goes to ``cache_dir()/kernels/<name>-<key>.so``, ``key`` a hash of the sources and the
headers beside them (``*.h`` and ``simd/*.h``, which they include), the compile flags, torch's version and
the Python version. A build takes a lock on its library's name, so a second process waits for the first's
build and loads it instead of building again; it runs in a folder of its own (removed after, and by the
next build if a process was killed midway) and its library is renamed into place, so a reader never sees a
partial file. The one build a user waits for says so, in one line
with its time, on stderr.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from marspec.models.cache import cache_dir


class BuildError(RuntimeError):
    """A library could not be built here; its message is one line a user can act on."""


def kernels_dir() -> Path:
    """Where the compiled operator libraries are kept."""
    return cache_dir() / "kernels"


def library_path(name: str, sources: Sequence[Path], flags: Sequence[str]) -> Path:
    """The cached library built from ``sources`` with ``flags`` by this torch and Python."""
    headers = sorted({header for source in sources for header in source.parent.glob("**/*.h")})
    texts = [path.read_bytes() for path in [*sources, *headers]]
    ident = b"\0".join([*texts, " ".join(flags).encode(), torch.__version__.encode(), sys.version.encode()])
    return kernels_dir() / f"{name}-{hashlib.sha256(ident).hexdigest()[:16]}.so"


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """PATH with a ninja binary on it for the build: the system's, else the one pip's ``ninja`` installs."""
    if shutil.which("ninja") is not None:
        yield
        return
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError as exc:
        raise RuntimeError("no ninja binary (install the `ninja` package)") from exc
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, before])
    try:
        yield
    finally:
        os.environ["PATH"] = before


def _cpp_extension() -> types.ModuleType:
    """``torch.utils.cpp_extension``, imported without its warning that no CUDA runtime is found: the
    operators built here are for the CPU, and the warning would be a second, misleading line."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        logger.setLevel(level)
    return cpp_extension


def _first_error(output: str) -> str:
    """The compiler's first error line in a failed build's output (the command lines before it say
    nothing), else the output's first line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower() and not line.startswith(("[", "FAILED:")) and " -o " not in line:
            return line
    return lines[0] if lines else "no output"


def load_library(name: str, sources: Sequence[Path], flags: Sequence[str], label: str | None = None) -> None:
    """Load the operators ``sources`` register, compiling them first into one library (with ``flags``,
    which the linker gets too) if no cached build exists; ``label`` names it in the line a build prints.
    Raises :class:`BuildError` (one line) where the cache cannot be written or the compiler fails."""
    library = library_path(name, sources, flags)
    if library.is_file():
        torch.ops.load_library(str(library))
        return
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        lock = open(library.with_suffix(".lock"), "a")  # noqa: SIM115 (held for the build below)
    except OSError as exc:
        raise BuildError(
            f"marspec's kernels cannot be built into {library.parent} ({exc.strerror}): "
            "set MARSPEC_CACHE_DIR to a writable folder"
        ) from exc
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process's build of the same library: wait for it
        if library.is_file():  # built by another process meanwhile
            torch.ops.load_library(str(library))
            return
        for stale in library.parent.glob(f".{name}-*"):  # a build killed midway (none runs: the lock is ours)
            shutil.rmtree(stale, ignore_errors=True)
        _build(name, sources, flags, library, label or name)  # loads it from the build folder


def _build(name: str, sources: Sequence[Path], flags: Sequence[str], library: Path, label: str) -> None:
    """Compile ``sources`` into ``library`` (a folder of its own, then renamed into place), saying so on
    stderr in one line with the time it took."""
    cpp_extension = _cpp_extension()
    print(
        f"marspec: building the CPU {label} (once, into {library.parent}) ...",
        end="",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(dir=library.parent, prefix=f".{name}-") as build, _ninja_on_path():
            cpp_extension.load(
                name=name,
                sources=[str(source) for source in sources],
                extra_cflags=list(flags),
                extra_ldflags=list(flags),
                extra_include_paths=[str(sources[0].parent)],
                build_directory=build,
                is_python_module=False,
                verbose=False,
            )
            os.replace(Path(build) / f"{name}.so", library)
    except (RuntimeError, OSError) as exc:
        print(" failed", file=sys.stderr, flush=True)
        names = ", ".join(source.name for source in sources)
        raise BuildError(f"building {names} failed: {_first_error(str(exc))}") from exc
    print(f" done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
