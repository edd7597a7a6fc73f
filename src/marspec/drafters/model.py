"""An independent draft model that shares the target's tokenizer."""

from __future__ import annotations

import torch

from marspec.errors import MarspecError
from marspec.interfaces import CausalLM, Draft
from marspec.verify import sample_token


class ModelDrafter:
    """Drafts autoregressively with a smaller causal LM, one cheap forward per drafted token.

    Its KV cache follows the committed sequence: after each verification the loop rolls it back to the
    accepted prefix, and the next proposal feeds only the tokens it has not seen yet.

    ``min_confidence`` makes the draft length adaptive: a drafted token whose probability under the draft
    (at temperature 1) is below it ends the draft. That token is still proposed (verifying one more
    position costs a fraction of a draft forward), but no forward is spent guessing past it, since the
    positions after an unsure guess are rarely accepted. 0 always drafts ``k`` tokens.
    """

    def __init__(self, lm: CausalLM, target_vocab_size: int, min_confidence: float = 0.0) -> None:
        if not 0.0 <= min_confidence <= 1.0:
            raise MarspecError(f"draft min_confidence must be in [0, 1], got {min_confidence!r}")
        self.draft_model: CausalLM = lm
        self.name = lm.name
        self.target_vocab_size = target_vocab_size
        self.min_confidence = min_confidence

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        temperature: float,
        generator: torch.Generator | None,
        alternatives: int = 0,
    ) -> Draft:
        # The draft cache never holds the newest token (the target's last correction or bonus): feed it,
        # and any tokens the drafter did not score itself (accepted drafts of another drafter), at once.
        lm = self.draft_model
        logits = lm.forward(context[lm.cached_len :], last_only=True)[-1]  # [V_draft]
        device = logits.device
        tokens = torch.empty(k, dtype=torch.long, device=device)
        probs = torch.empty(k, self.target_vocab_size, device=device) if temperature > 0 else None
        # Next-best tokens come from the logits each chain token is drafted from: no extra forward.
        ranked = None
        if alternatives and probs is None:
            ranked = torch.empty(k, 1 + alternatives, dtype=torch.long, device=device)  # [k, 1 + A]
        n = 0
        while n < k:
            if ranked is not None:
                ranked[n] = torch.topk(logits, 1 + alternatives).indices
                tokens[n] = ranked[n, 0]
            elif probs is None:
                tokens[n] = torch.argmax(logits)
            else:
                q = self._to_target_vocab(torch.softmax(logits / temperature, dim=-1))
                probs[n] = q
                tokens[n] = sample_token(q, generator)[0]
            n += 1
            if n == k or self._unsure(logits):
                break
            logits = lm.forward(tokens[n - 1 : n])[-1]
        return Draft(
            tokens=tokens[:n],
            probs=None if probs is None else probs[:n],
            alternatives=None if ranked is None else ranked[:n, 1:],
        )

    def _unsure(self, logits: torch.Tensor) -> bool:
        """Whether the draft's top probability here is below ``min_confidence``: one host read per
        drafted token while the stop is on, and it has to be. The stop decides whether the next draft
        forward runs at all, so the host needs the value before it would queue that forward. Reading it
        after queuing the next forward anyway would pay that forward's launch on every stopped draft (on a
        GPU at batch size one a forward's time is mostly the host launching its kernels), and reading a
        few tokens' values at once would run the very forwards the stop exists to save. On the CPU the
        read waits for nothing: the value is computed when the call returns."""
        if self.min_confidence <= 0.0:
            return False  # no softmax, no host sync
        return float(torch.softmax(logits, dim=-1).max()) < self.min_confidence

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
        self.draft_model.rollback(min(self.draft_model.cached_len, valid_len))

    def reset(self) -> None:
        self.draft_model.reset()
