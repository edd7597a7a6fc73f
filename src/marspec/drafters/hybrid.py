"""Prompt lookup first, the draft model otherwise."""

from __future__ import annotations

from collections.abc import Callable

import torch

from marspec.drafters.ngram import NgramDrafter
from marspec.errors import MarspecError
from marspec.forward_requests import Asks, ProposesInSteps, cannot_batch, propose
from marspec.interfaces import CausalLM, Draft, Drafter


class HybridDrafter(ProposesInSteps):
    """Copies from the context when its tail recurs there (free), asks the draft model (or an EAGLE-3
    head) when it does not.

    Code and quoted text often repeat what came before (a signature, a variable, a line being edited);
    there a lookup costs nothing while the model pays a forward per token. The lookup only wins if its
    match is long enough to be specific: ``lookup.min_ngram`` sets that (3 by default, since one- and
    two-token matches mostly copy the wrong continuation). The model's KV cache simply falls behind while
    the lookup drafts; its next proposal catches up in one forward.
    """

    def __init__(self, model: Drafter, lookup: NgramDrafter | None = None) -> None:
        self.model = model
        self.lookup = lookup if lookup is not None else NgramDrafter(max_ngram=4, min_ngram=3)
        self.draft_model = model.draft_model
        self.name = f"{self.lookup.name}+{model.name}"

    def propose_steps(
        self,
        context: torch.Tensor,
        k: int,
        temperature: float,
        generator: torch.Generator | None,
        alternatives: int = 0,
        distributions: bool = False,
    ) -> Asks[Draft]:
        """:meth:`propose`, asking for the model's forwards (:mod:`marspec.forward_requests`)."""
        # A lookup draft is deterministic (q one-hot), which sampling verification handles losslessly too.
        draft = self.lookup.propose(context, k, temperature, generator)
        if len(draft):
            return draft
        model = propose(self.model, context, k, temperature, generator, alternatives, distributions)
        return (yield from model)

    def for_slot(self, target: CausalLM, view: Callable[[CausalLM], CausalLM]) -> HybridDrafter:
        """Its twin for one sequence of a batch: the model drafter's twin and a lookup of its own."""
        twin = getattr(self.model, "for_slot", None)
        if twin is None:
            raise MarspecError(cannot_batch(self.model))
        return HybridDrafter(twin(target, view), self.lookup.for_slot(target, view))

    def rollback(self, valid_len: int) -> None:
        self.model.rollback(valid_len)

    def reset(self) -> None:
        self.model.reset()
