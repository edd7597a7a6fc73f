"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the context's tail."""

from __future__ import annotations

from collections.abc import Callable

import torch

from marspec.errors import MarspecError
from marspec.interfaces import CausalLM, Draft


class NgramDrafter:
    """n-gram prompt lookup (no model): cheap, strong when the output repeats the input (code edits, RAG).

    The longest tail n-gram (``max_ngram`` down to ``min_ngram`` tokens) that occurred earlier in the
    context is located; the tokens that followed its most recent earlier occurrence are the draft.
    """

    name = "ngram"
    draft_model = None  # lookup costs no model forwards

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise MarspecError(
                f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        temperature: float,
        generator: torch.Generator | None,
        alternatives: int = 0,
        distributions: bool = False,
    ) -> Draft:
        # A copied continuation has no runner-up tokens and no distribution: ``alternatives`` and
        # ``distributions`` are ignored.
        length = int(context.shape[0])
        sizes = range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1)
        if not sizes:
            return Draft(tokens=context.new_empty(0))
        # For every n-gram size at once, on the device: 1 + the start of the tail's latest earlier
        # occurrence (0 when none). One host read then picks the longest size that occurred.
        latest = []
        for n in sizes:
            tail = context[length - n :]
            # windows[i] = context[i : i + n] for every earlier start i (the tail itself is excluded)
            windows = context[: length - 1].unfold(0, n, 1)  # [length - n, n]
            hits = (windows == tail).all(dim=1)  # bool[length - n]
            starts = torch.arange(1, length - n + 1, device=context.device)
            latest.append((hits * starts).max())
        for n, found in zip(sizes, torch.stack(latest).tolist(), strict=True):
            if found:
                start = found - 1 + n
                return Draft(tokens=context[start : start + k].clone())
        return Draft(tokens=context.new_empty(0))

    def for_slot(self, target: CausalLM, view: Callable[[CausalLM], CausalLM]) -> NgramDrafter:
        """Its twin for one sequence of a batch (:mod:`marspec.batch.slots`): the same sizes; a lookup
        needs no model and no state, so a batch's lookups cost no forward."""
        return NgramDrafter(self.max_ngram, self.min_ngram)

    def rollback(self, valid_len: int) -> None:
        """Stateless: nothing to forget."""

    def reset(self) -> None:
        """Stateless: nothing to reset."""
