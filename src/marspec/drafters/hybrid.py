"""Prompt lookup first, the draft model otherwise."""

from __future__ import annotations

import torch

from marspec.drafters.ngram import NgramDrafter
from marspec.interfaces import Draft, Drafter


class HybridDrafter:
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

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        temperature: float,
        generator: torch.Generator | None,
        alternatives: int = 0,
        distributions: bool = False,
    ) -> Draft:
        # A lookup draft is deterministic (q one-hot), which sampling verification handles losslessly too.
        draft = self.lookup.propose(context, k, temperature, generator)
        if len(draft):
            return draft
        return self.model.propose(context, k, temperature, generator, alternatives, distributions)

    def rollback(self, valid_len: int) -> None:
        self.model.rollback(valid_len)

    def reset(self) -> None:
        self.model.reset()
