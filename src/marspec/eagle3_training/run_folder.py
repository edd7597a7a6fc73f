"""A run's folder: ``state.json`` (the settings its shards were made with, the next document, the round,
the tokens trained on, the draft vocabulary), ``log.jsonl``, ``shards/``, ``head/`` and the optimiser's
state. Every file is replaced whole, so a stopped run resumes at its last complete round."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# What the stored shards and the head's shape depend on is fixed for a run; how it is optimised may
# change when it is resumed (the log records each round's settings).
FIXED = (
    "target",
    "corpus",
    "dtype",
    "chunk",
    "shard_chunks",
    "per_doc",
    "top",
    "draft_vocab",
    "intermediate",
    "steps",
)


class RunFolder:
    """The folder ``path`` (made if missing) and its state (empty for a run not begun)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        (path / "shards").mkdir(exist_ok=True)
        self.state_path = path / "state.json"
        self.state: dict[str, Any] = (
            json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        )
        self.head_dir = path / "head"
        self.optimizer_path = path / "optimizer.pt"

    def check_settings(self, settings: dict[str, Any]) -> None:
        """Exit unless a run begun here was begun with ``settings`` (its FIXED ones)."""
        # (A run begun before --corpus existed read the default corpus: its missing setting reads None.)
        if self.state and {k: self.state["settings"].get(k) for k in FIXED} != settings:
            sys.exit(
                f"{self.path} was started with other settings ({self.state['settings']}): use another --run"
            )

    def begin(self, settings: dict[str, Any], draft_ids: list[int]) -> None:
        """Begin the run: round 0, no document read, with these settings and draft vocabulary."""
        self.state = {
            "settings": settings,
            "next_doc": 0,
            "round": 0,
            "tokens_trained": 0,
            "draft_ids": draft_ids,
        }
        self.save_state()

    def save_state(self) -> None:
        self.state_path.write_text(json.dumps(self.state))

    def shard_path(self, i: int) -> Path:
        return self.path / "shards" / f"{i:05d}.safetensors"

    def log(self, record: dict) -> None:
        """Append ``record`` to ``log.jsonl`` and print it."""
        with open(self.path / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
