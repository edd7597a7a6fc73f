"""Shards: the target's scores of a run's chunks, collected once each and kept in the run folder (shard 0
is the held-out one)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from marspec.eagle3_training.corpus import Document, chunks_of
from marspec.eagle3_training.run_folder import RunFolder

if TYPE_CHECKING:
    from marspec.backends.hf import HFCausalLM

Shard = dict[str, torch.Tensor]  # tokens, states, top_ids, top_lp; one row per chunk


def collect_shard(target, layers: tuple[int, ...], chunks: list[list[int]], top: int, path: Path) -> None:
    """Score each chunk with the target and save tokens, feature states and top log-probabilities."""
    from safetensors.torch import save_file

    tokens, states, top_ids, top_lp = [], [], [], []
    for ids in chunks:
        t = torch.tensor(ids)
        target.reset()
        logits = target.forward(t)  # [T, V] float32
        lp = torch.log_softmax(logits, dim=-1)
        values, indices = lp.topk(top, dim=-1)
        tokens.append(t.int())
        states.append(target.hidden_states(0, len(ids), layers).to(torch.bfloat16))
        top_ids.append(indices.int())
        top_lp.append(values.half())
    tmp = path.with_suffix(".tmp")
    save_file(
        {
            "tokens": torch.stack(tokens),
            "states": torch.stack(states),
            "top_ids": torch.stack(top_ids),
            "top_lp": torch.stack(top_lp),
        },
        str(tmp),
    )
    tmp.rename(path)


@dataclass(frozen=True)
class ShardShape:
    """What a shard holds: ``chunks`` chunks of ``chunk`` tokens, at most ``per_doc`` from one document,
    with the target's ``top`` log-probabilities at each position."""

    chunks: int
    chunk: int
    per_doc: int
    top: int


class Shards:
    """A run's shards, each collected from the next documents the first time it is asked for (and the
    run's state saved with the next document's index), read from its file after."""

    def __init__(
        self,
        run: RunFolder,
        target: HFCausalLM,
        layers: tuple[int, ...],
        docs: list[Document],
        shape: ShardShape,
    ) -> None:
        self.run, self.target, self.layers, self.docs, self.shape = run, target, layers, docs, shape

    def get(self, i: int) -> Shard:
        """Shard ``i``, collected first if it is not yet; exits when the corpus is used up."""
        from safetensors.torch import load_file

        path = self.run.shard_path(i)
        if not path.exists():
            self._collect(i, path)
        return load_file(str(path))

    def _collect(self, i: int, path: Path) -> None:
        state, shape = self.run.state, self.shape
        t0 = time.perf_counter()
        chunks, nxt = chunks_of(
            self.target.tokenizer, self.docs, state["next_doc"], shape.chunks, shape.chunk, shape.per_doc
        )
        if not chunks:
            sys.exit("the corpus is used up")
        with torch.inference_mode():
            collect_shard(self.target, self.layers, chunks, shape.top, path)
        state["next_doc"] = nxt
        self.run.save_state()
        took = time.perf_counter() - t0
        self.run.log(
            {"event": "collect", "shard": i, "tokens": len(chunks) * shape.chunk, "seconds": round(took, 1)}
        )
