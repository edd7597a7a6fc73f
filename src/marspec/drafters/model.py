"""An independent draft model that shares the target's tokenizer."""

from __future__ import annotations

from collections.abc import Callable

import torch

from marspec.errors import MarspecError
from marspec.forward_requests import Asks, Forward, ProposesInSteps
from marspec.interfaces import CausalLM, Draft
from marspec.verify.chain import sample_token
from marspec.verify.top_tokens import argmax


class ModelDrafter(ProposesInSteps):
    """Drafts autoregressively with a smaller causal LM, one cheap forward per drafted token.

    Its KV cache follows the committed sequence: after each verification the loop rolls it back to the
    accepted prefix, and the next proposal feeds only the tokens it has not seen yet.

    ``min_confidence`` makes the draft length adaptive: a drafted token whose probability under the draft
    (at temperature 1) is below it ends the draft. That token is still proposed (verifying one more
    position costs a fraction of a draft forward), but no forward is spent guessing past it, since the
    positions after an unsure guess are rarely accepted. 0 always drafts ``k`` tokens.

    ``stop_chunk`` is how many tokens are drafted between two reads of the stop: each read is one host
    read of the chunk's confidences, computed on the device. 1 (the default, on every device) reads
    after every token, so no forward is spent past an unsure token. More lets the host queue a chunk's
    forwards without waiting for each, at the price of up to ``stop_chunk - 1`` forwards past an unsure
    token. On an H200 with replayed CUDA graphs a read cost ~0.04 ms against ~2.8 ms for a wasted
    forward of the default draft (docs/results.md, "On a GPU"), so reading after every token is the
    better trade there too. The draft is the same either way: it ends at the first unsure token.
    """

    def __init__(
        self,
        lm: CausalLM,
        target_vocab_size: int,
        min_confidence: float = 0.0,
        stop_chunk: int = 1,
    ) -> None:
        if not 0.0 <= min_confidence <= 1.0:
            raise MarspecError(f"draft min_confidence must be in [0, 1], got {min_confidence!r}")
        if isinstance(stop_chunk, bool) or not isinstance(stop_chunk, int) or stop_chunk < 1:
            raise MarspecError(f"draft stop_chunk must be an integer >= 1, got {stop_chunk!r}")
        self.draft_model: CausalLM = lm
        self.name = lm.name
        self.target_vocab_size = target_vocab_size
        self.min_confidence = min_confidence
        self.stop_chunk = stop_chunk

    def propose_steps(
        self,
        context: torch.Tensor,
        k: int,
        temperature: float,
        generator: torch.Generator | None,
        alternatives: int = 0,
        distributions: bool = False,
    ) -> Asks[Draft]:
        """:meth:`propose`, asking for its draft model's forwards (:mod:`marspec.forward_requests`), so
        that the forwards of many sequences' drafts can run together."""
        # The draft cache never holds the newest token (the target's last correction or bonus): feed it,
        # and any tokens the drafter did not score itself (accepted drafts of another drafter), at once.
        lm = self.draft_model
        logits = (yield Forward(lm, context[lm.cached_len :], last_only=True))[-1]  # [V_draft]
        base = lm.cached_len
        device = logits.device
        tokens = torch.empty(k, dtype=torch.long, device=device)
        sampling = temperature > 0
        wants = sampling or distributions
        probs = torch.empty(k, self.target_vocab_size, device=device) if wants else None
        # Next-best tokens come from the logits each chain token is drafted from: no extra forward.
        ranked = None
        if alternatives and probs is None:
            ranked = torch.empty(k, 1 + alternatives, dtype=torch.long, device=device)  # [k, 1 + A]
        # The stop: each token's confidence, on the device, read once per chunk (see the class).
        stop = self.min_confidence > 0.0
        sure = logits.new_empty(k, dtype=torch.bool) if stop else None  # on the logits' device
        n = read = 0  # tokens drafted; tokens whose confidence was read
        while n < k:
            if ranked is not None:
                ranked[n] = torch.topk(logits, 1 + alternatives).indices
                tokens[n] = ranked[n, 0]
            elif probs is None:
                tokens[n] = argmax(logits)
            else:
                q = self._to_target_vocab(torch.softmax(logits / (temperature if sampling else 1.0), dim=-1))
                probs[n] = q
                tokens[n] = sample_token(q, generator)[0] if sampling else argmax(logits)
            if sure is not None and n + 1 < k:  # the last token's confidence is never read (below)
                sure[n] = torch.softmax(logits, dim=-1).max() >= self.min_confidence
            n += 1
            if n == k:
                break
            if sure is not None and n - read >= self.stop_chunk:
                stopped = _first_unsure(sure, read, n)
                if stopped is not None:
                    n = stopped + 1
                    break
                read = n
            logits = (yield Forward(lm, tokens[n - 1 : n]))[-1]
        # The last token's confidence never matters (no token follows it); the others' must be read.
        if sure is not None and n == k and read < k - 1:
            stopped = _first_unsure(sure, read, k - 1)
            n = n if stopped is None else stopped + 1
        # Forwards past the stop are forgotten: the cache holds the draft but its last token, as when
        # the stop is read after every token (so the next catch-up forward has the same shape).
        lm.rollback(min(lm.cached_len, base + n - 1))
        return Draft(
            tokens=tokens[:n],
            probs=None if probs is None else probs[:n],
            alternatives=None if ranked is None else ranked[:n, 1:],
        )

    def for_slot(self, target: CausalLM, view: Callable[[CausalLM], CausalLM]) -> ModelDrafter:
        """Its twin for one sequence of a batch (:mod:`marspec.batch.slots`): the same settings over
        ``view`` of its draft model (a cache of its own, its forwards run with the other sequences')."""
        lm = view(self.draft_model)
        return ModelDrafter(lm, self.target_vocab_size, self.min_confidence, self.stop_chunk)

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


def _first_unsure(sure: torch.Tensor, start: int, end: int) -> int | None:
    """The first index in ``start .. end - 1`` whose token was unsure (``sure``: bool[k] on the device),
    or None: one host read, of that chunk. It has to be a read: the stop decides whether the next draft
    forward is queued at all."""
    flags = sure[start:end].tolist()
    return next((start + i for i, ok in enumerate(flags) if not ok), None)
