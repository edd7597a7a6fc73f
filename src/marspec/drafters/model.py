"""An independent draft model that shares the target's tokenizer."""

from __future__ import annotations

import torch

from marspec.backends.hf import HFCausalLM
from marspec.drafters.base import Draft
from marspec.verify import sample_token


class ModelDrafter:
    """Drafts autoregressively with a smaller causal LM, one cheap forward per drafted token.

    Its KV cache follows the committed sequence: after each verification the loop rolls it back to the
    accepted prefix, and the next proposal feeds only the tokens it has not seen yet.
    """

    def __init__(self, lm: HFCausalLM, target_vocab_size: int) -> None:
        self.lm = lm
        self.name = lm.name
        self.target_vocab_size = target_vocab_size

    def propose(
        self, context: torch.Tensor, k: int, temperature: float, generator: torch.Generator | None
    ) -> Draft:
        # The draft cache never holds the newest token (the target's last correction or bonus): feed it,
        # and any accepted tokens the drafter did not score itself, in one forward.
        logits = self.lm.forward(context[self.lm.cached_len :], last_only=True)[-1]  # [V_draft]
        tokens = torch.empty(k, dtype=torch.long)
        probs = torch.empty(k, self.target_vocab_size) if temperature > 0 else None
        for i in range(k):
            if probs is None:
                tokens[i] = torch.argmax(logits)
            else:
                q = self._to_target_vocab(torch.softmax(logits / temperature, dim=-1))
                probs[i] = q
                tokens[i] = sample_token(q, generator)[0]
            if i + 1 < k:
                logits = self.lm.forward(tokens[i : i + 1])[-1]
        return Draft(tokens=tokens, probs=probs)

    def _to_target_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """Pad or cut q to the target's logit width (same tokenizer, but embeddings may be padded)."""
        width = self.target_vocab_size
        if q.shape[0] == width:
            return q
        if q.shape[0] > width:
            q = q[:width]
            return q / q.sum()
        return torch.nn.functional.pad(q, (0, width - q.shape[0]))

    def rollback(self, valid_len: int) -> None:
        self.lm.rollback(min(self.lm.cached_len, valid_len))

    def reset(self) -> None:
        self.lm.reset()
