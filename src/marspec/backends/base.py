"""What the decode loop, the drafters and the profiler need of a model: the backend protocol.

A backend scores new tokens on top of its own KV cache and can forget cached positions. Everything
else (tokenizers, chat templates, weight loading) lives outside it, so a second backend (llama.cpp, a
compiled model, another device) implements only this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from marspec.tree import DraftTree


@dataclass
class ForwardClock:
    """Wall time spent inside a model's forwards, and how many there were: read before and after a
    generation, the difference is that generation's model time (the rest is the loop's overhead)."""

    seconds: float = 0.0
    calls: int = 0

    def tick(self, seconds: float) -> None:
        self.seconds += seconds
        self.calls += 1


@runtime_checkable
class CausalLM(Protocol):
    """A causal language model with a KV cache that is extended by forwards and rolled back in place."""

    name: str
    vocab_size: int  # rows of the LM head's output (may exceed the tokenizer's vocabulary)
    context_length: int  # most positions the model attends to; 0 when unknown
    eos_token_ids: frozenset[int]  # tokens that end a generation
    device: torch.device  # where the weights, the caches and returned logits live
    clock: ForwardClock

    @property
    def cached_len(self) -> int:
        """Number of positions held in the KV cache."""
        ...

    def reset(self) -> None:
        """Drop the cache (a new sequence starts)."""
        ...

    def keep_prefix(self, ids: torch.Tensor) -> int:
        """Keep the longest cached prefix that equals the start of ``ids`` (long[n]), drop the rest, and
        return its length: a new sequence that starts like the cached one (the next turn of a chat)
        need not score that prefix again. A backend that cannot keep one resets and returns 0."""
        ...

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append ``tokens`` (long[n], n >= 1) to the cache; return float32 logits [n, V], or [1, V] for
        the last position only when ``last_only``."""
        ...

    def forward_tree(self, tree: DraftTree, root: torch.Tensor) -> torch.Tensor:
        """Score ``root`` (long[1]) and ``tree``'s nodes in one forward, each node attending to the cache
        and its ancestors only; return float32 logits [N+1, V]. :meth:`keep_path` must follow."""
        ...

    def keep_path(self, base: int, path: tuple[int, ...]) -> None:
        """After :meth:`forward_tree` with the root at ``base``: keep the root and ``path``'s nodes as
        positions ``base + 1 ...``, drop the rest of the tree."""
        ...

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` cached positions."""
        ...
