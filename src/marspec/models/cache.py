"""The cache of converted model folders: where it is, what a complete folder holds, and its locks."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path

from marspec.errors import MarspecError

# Bumped when the layout of a converted folder changes; folders of an unreadable format are reconverted.
# 2: a known model's folder holds its GGUF (GGUF_FILE); the float32 weights are written on first need.
# 3: a known model's folder may have released its GGUF (its marker says GGUF_RELEASED), which is then
# assembled again from its installed packages when a form not stored yet needs it.
CACHE_FORMAT = 3
_READABLE_FORMATS = (1, 2, 3)  # format 1 folders hold float32 weights only, which 2 and 3 read as they are
MARKER_FILE = "marspec.json"
GGUF_RELEASED = "gguf_released"
WEIGHTS_FILE = "model.safetensors"
GGUF_FILE = "model.gguf"


def cache_dir() -> Path:
    """$MARSPEC_CACHE_DIR, else $XDG_CACHE_HOME/marspec, else ~/.cache/marspec."""
    explicit = os.environ.get("MARSPEC_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "marspec"


def models_root() -> Path:
    return cache_dir() / "models"


def gguf_cache_key(path: Path) -> str:
    """A folder name for a user's .gguf: its stem plus a hash of resolved path, size and mtime."""
    st = path.stat()
    ident = f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).strip("-.")[:60] or "model"
    return f"gguf-{stem}-{hashlib.sha256(ident).hexdigest()[:12]}"


def _safetensors_ok(path: Path) -> bool:
    """Whether a .safetensors file has a readable header whose tensors fit in the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len <= 0 or 8 + header_len > size:
                return False
            header = json.loads(f.read(header_len))
        end = max(
            (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
            default=0,
        )
        return 8 + header_len + end == size
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return False


def _gguf_ok(path: Path) -> bool:
    """Whether ``path`` starts as a GGUF file does (its checksum was verified when it was assembled)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def has_float_weights(folder: Path) -> bool:
    """Whether a converted folder holds its float32 weights already."""
    return _safetensors_ok(folder / WEIGHTS_FILE)


def held_gguf(folder: Path) -> Path | None:
    """The GGUF a converted folder holds (a known model's), or None."""
    path = folder / GGUF_FILE
    return path if _gguf_ok(path) else None


def gguf_released(folder: Path) -> bool:
    """Whether a converted folder (a known model's) released its GGUF: assembled again when needed."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and bool(marker.get(GGUF_RELEASED))


def mark_gguf_released(folder: Path) -> None:
    """Record in a converted folder's marker that its GGUF is released (a new marker renamed into place,
    in the format that knows what that means)."""
    path = folder / MARKER_FILE
    marker = json.loads(path.read_text()) | {"format": CACHE_FORMAT, GGUF_RELEASED: True}
    partial = folder / f".{MARKER_FILE}.tmp"
    partial.write_text(json.dumps(marker, indent=2) + "\n")
    share_file(partial)
    os.replace(partial, path)


def check_cached_folder(folder: Path) -> None:
    """Raise MarspecError naming `folder` if a converted folder is incomplete or damaged."""
    problem = None
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
        json.loads((folder / "config.json").read_text())
        json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError) as exc:
        problem = f"unreadable metadata ({type(exc).__name__})"
    else:
        if not isinstance(marker, dict) or marker.get("format") not in _READABLE_FORMATS:
            problem = "written by another marspec version"
        elif not has_float_weights(folder) and held_gguf(folder) is None and not marker.get(GGUF_RELEASED):
            problem = f"{WEIGHTS_FILE} is missing or truncated"
    if problem:
        raise MarspecError(
            f"cached model folder {folder} is corrupt ({problem}); delete it and it will be converted again"
        )


def share_file(path: Path) -> None:
    """Give a written file the usual permissions (some writers, safetensors' among them, create files
    owner-only), so a cache shared by several users stays readable."""
    mask = os.umask(0)
    os.umask(mask)
    path.chmod(0o666 & ~mask)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock, so two processes never convert the same model at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
