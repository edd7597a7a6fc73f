"""One sequence's views of a batch's shared models: a cache of its own over a model's weights.

The batch scheduler (:mod:`marspec.batch.scheduler`) runs the forwards these views are asked for
together with the other sequences' (:mod:`marspec.batch.gather`). A view's own ``forward`` runs it alone.
"""

from __future__ import annotations

import torch

from marspec.backends.fixed import QUERY_SIZES, FixedShapeLM, LengthOnlyCache
from marspec.backends.fixed_batch import HIDDEN_STATES_REFUSAL, SlotRows, shared_batch
from marspec.backends.hf import HFCausalLM
from marspec.backends.packed import rows_alone
from marspec.errors import MarspecError
from marspec.forward_requests import Forward, Request, TreeForward
from marspec.interfaces import DraftTree


class SlotLM(HFCausalLM):
    """One sequence's view of a shared model: its own KV cache (of the dtype its base's holds), its
    forwards run by the batch.

    Everything (rollback, prefix reuse, hidden states, a forward alone) is the transformers backend's
    own. A prompt longer than ``prefill_chunk`` tokens is scored in chunks of that size, one per batch
    step (:meth:`chunks`), so a new sequence's prefill shares the forwards of the running ones instead of
    stalling them; chunks are taken only where rows are computed alone, so chunking changes nothing the
    sequence decodes.
    """

    def __init__(self, base: HFCausalLM, prefill_chunk: int) -> None:
        super().__init__(base.model, base.tokenizer, base.name, base.position_cache, base.kv_dtype)
        self.prefill_chunk = prefill_chunk

    def chunks(self, tokens: torch.Tensor) -> int:
        """In how many forwards of the batch ``tokens`` are scored: one, or chunks of ``prefill_chunk``
        where a prompt scored in chunks is cached and scored as in one forward."""
        n, chunk = int(tokens.shape[0]), self.prefill_chunk
        if n <= chunk or not self._chunks_exactly():
            return 1
        return -(-n // chunk)

    def _chunks_exactly(self) -> bool:
        """Whether a prompt scored in chunks is cached and scored as in one forward."""
        return rows_alone(self)


class FixedSlotLM(LengthOnlyCache, SlotLM):
    """One sequence's view of a model on the fixed-shape path with a batch dimension: a slot of the
    shared :class:`~marspec.backends.fixed_batch.FixedBatch` (its rows of every layer's buffers), its
    forwards run together with the other slots' as one [B, m] forward (:meth:`batch_forward`). The host
    keeps the slot's cache length and token ids, so a rollback or a kept prefix copies nothing. A prompt
    is scored in chunks of at most the largest captured query size, one per step, so every forward is a
    captured shape and a new prompt shares the running sequences' steps.
    """

    def __init__(self, base: FixedShapeLM) -> None:
        super().__init__(base, QUERY_SIZES[-1])
        self._shared = shared_batch(base)
        self.slot = self._shared.claim()

    def release(self) -> None:
        """Give the slot back to the shared batch (the view is not used again)."""
        self._shared.release(self.slot)

    @property
    def direct(self) -> None:
        return None  # the shared batched forward runs transformers' model

    def capture_hidden_states(self, layers: tuple[int, ...]) -> None:
        raise MarspecError(HIDDEN_STATES_REFUSAL)

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        return self.batch_forward([Forward(self, tokens, last_only)])[0]

    def forward_tree(self, tree: DraftTree, root: torch.Tensor) -> torch.Tensor:
        return self.batch_forward([TreeForward(self, tree, root)])[0]

    def keep_path(self, base: int, path: tuple[int, ...]) -> None:
        for i, node in enumerate(path, start=1):
            if node != i:
                self._shared.move(self.slot, base + node, base + i)
                self._ids[base + i] = self._ids[base + node]
        self.rollback(base + 1 + len(path))

    def _chunks_exactly(self) -> bool:
        return True  # every slot's rows meet only its own: chunks of captured sizes, the same cache

    def batch_forward(self, requests: list[Request]) -> list[torch.Tensor]:
        """Run ``requests`` (forwards of slots of this view's batch, one each) as one batched forward;
        each slot's length and ids advance as its own forward's would."""
        lms: list[FixedSlotLM] = [request.lm for request in requests]  # type: ignore[misc]
        rows = []
        for lm, request in zip(lms, requests, strict=True):
            if isinstance(request, TreeForward):
                tokens = torch.cat((request.root, request.tree.tokens))
                rows.append(SlotRows(lm.slot, lm.cached_len, tokens, request.tree))
            else:
                rows.append(SlotRows(lm.slot, lm.cached_len, request.tokens, None, request.last_only))
        start = self._timer.start()
        results = self._shared.run(rows)
        self._timer.stop(start, also=[lm.clock for lm in lms if lm is not self])  # all waited for all of it
        for lm, row in zip(lms, rows, strict=True):
            lm.note_appended(row.tokens)
        return results
