"""The drafter protocol: who proposes the tokens the target verifies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from marspec.backends.base import CausalLM


@dataclass(frozen=True)
class Draft:
    """Tokens proposed for the next positions.

    ``probs`` is the drafter's real distribution q over the target's vocabulary at each drafted position
    ([k, V], float32), present only when the drafter sampled its tokens (temperature > 0); lossless
    speculative sampling needs it. ``None`` means the tokens were chosen deterministically.

    ``alternatives`` are the drafter's next-best tokens at each drafted position, best first, present
    when it was asked for them (token-tree drafting) and has them; a lookup drafter has none.
    """

    tokens: torch.Tensor  # long[k], k may be 0 when the drafter has nothing to offer
    probs: torch.Tensor | None = None  # float32[k, V]
    alternatives: torch.Tensor | None = None  # long[k, A]

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@runtime_checkable
class Drafter(Protocol):
    """Anything that can propose draft tokens after a context."""

    name: str
    # The model whose forwards drafting runs (its clock is drafting's cost); None for a lookup drafter.
    draft_model: CausalLM | None

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        temperature: float,
        generator: torch.Generator | None,
        alternatives: int = 0,
    ) -> Draft:
        """Propose up to ``k`` tokens to follow ``context`` (long[L], the whole committed sequence), and,
        if it can, its ``alternatives`` next-best tokens at each position (greedy drafting only)."""
        ...

    def rollback(self, valid_len: int) -> None:
        """The first ``valid_len`` tokens of the context are final; forget any state beyond them."""
        ...

    def reset(self) -> None:
        """A new sequence starts."""
        ...
