"""A pair's measured costs and draft record, kept in the model cache per processor and thread count.

One JSON file per (processor, torch threads, kernels, target and its weights, draft and its weights) under
``<cache>/draft-length/``. It keeps what was measured, not what was chosen from it, so a changed cost
model or a stop named by the user is worked out again from the same measurements at each load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from marspec.draft_length.measure import Measured
from marspec.models import cache_dir

FILE_VERSION = 3  # 2: the kernels a pair ran on, a field of their own; 3: a Q4_K draft's narrow-first head


@dataclass(frozen=True)
class PairKey:
    """What a pair's costs depend on: the processor, thread count and kernels (their path and build), and
    each model in its weights."""

    cpu: str
    threads: int
    kernels: str
    target: str
    target_weights: str
    draft: str
    draft_weights: str

    def path(self) -> Path:
        """``<cache>/draft-length/<target>-<draft>-<hash of the whole key>.json``."""
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{Path(self.target).name}-{Path(self.draft).name}")
        return cache_dir() / "draft-length" / f"{name}-{digest}.json"


def load(key: PairKey) -> Measured | None:
    """What was measured for ``key``, or None when nothing (readable, of this version) was."""
    try:
        data = json.loads(key.path().read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != FILE_VERSION or data.get("key") != asdict(key):
        return None
    try:
        return Measured(
            target_s={int(n): float(s) for n, s in data["target_s"].items()},
            draft_s=float(data["draft_s"]),
            confidences=[float(c) for c in data["confidences"]],
            accepted=[bool(a) for a in data["accepted"]],
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def stored_on(cpu: str) -> list[tuple[PairKey, Measured]]:
    """Every pair measured on the processor named ``cpu``, with its measurements."""
    found = []
    for path in sorted((cache_dir() / "draft-length").glob("*.json")):
        try:
            key = PairKey(**json.loads(path.read_text())["key"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        measured = load(key) if key.cpu == cpu else None
        if measured is not None:
            found.append((key, measured))
    return found


def save(key: PairKey, measured: Measured) -> Path:
    """Store ``measured`` for ``key``, atomically (a failure never leaves half a file)."""
    path = key.path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"version": FILE_VERSION, "key": asdict(key), **asdict(measured)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".draft-length-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path
