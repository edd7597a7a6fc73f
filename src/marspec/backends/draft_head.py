"""A draft's output layer that scores the likeliest part of its vocabulary first.

A draft token costs about the bytes of the draft's weights it reads, and on the default CPU pair the
output layer is over a quarter of them (Qwen2.5-Coder-0.5B: 151,936 rows of Q4_K, 83 of 299 MB a step).
Byte-pair vocabularies number their tokens roughly in the order their merges were learnt, the common ones
first, and the ids a tokenizer adds (chat markers, end of text) come last. :class:`NarrowFirstHead` scores
the first :data:`NARROW_IDS` ids and the added ones first; where the draft is sure among them (its top
probability over them at least :data:`SURE`), it proposes from them and leaves the other ids unscored
(their logits -inf); elsewhere it scores those too, and the row's logits are the whole layer's. A
proposal only costs acceptance when it is wrong, never correctness: the target verifies every token.

Measured on the default pair (AMD EPYC Zen 4; the calibration text and six prompts of our own, 1,048
positions, teacher-forced): the draft was sure among the narrow ids at 65% of positions, so a step scores
~63% of the layer's rows, and the draft's tokens agreed with the target's at 84.45% of positions against
84.54% with the whole layer. Each row's scores are the whole layer's bits on the columns it scores (the
same kernel on the same blocks and the same quantised row), and its choice of part depends on that row
alone, so a row drafts the same whatever else is in its forward (packed batches draft as solo runs do).
"""

from __future__ import annotations

import torch

from marspec.backends.q4k import TILE, Q4KLinear
from marspec.errors import MarspecError

NARROW_IDS = 65536  # the ids scored first, from 0, with the added ones (97.8% of the tokens of our docs)
SURE = 0.8  # the top probability among them from which the rest is not scored


class NarrowFirstHead(torch.nn.Module):
    """``head``'s columns ``[0, narrow_end)`` and ``[tail_start, out_features)`` scored first, the rest
    ``[narrow_end, tail_start)`` only for the rows whose top probability over the first two is below
    ``sure`` (elsewhere -inf). Both bounds are multiples of :data:`TILE`. :attr:`narrow_first` False
    scores every row whole (for comparisons)."""

    def __init__(self, head: Q4KLinear, narrow_end: int, tail_start: int, sure: float = SURE) -> None:
        super().__init__()
        if narrow_end % TILE or tail_start % TILE or not 0 < narrow_end < tail_start < head.out_features:
            raise MarspecError(f"[0, {narrow_end}) and [{tail_start}, ...) are not whole tiles of the head")
        if head.bias is not None:
            raise MarspecError("a head with a bias is scored whole")
        self.head = head
        self.narrow_end, self.tail_start, self.sure = narrow_end, tail_start, sure
        self.in_features, self.out_features = head.in_features, head.out_features

        def part(start: int, end: int) -> Q4KLinear:  # columns [start, end): views of the head's tiles
            tiles = head.blocks[start // TILE : -(-end // TILE)]
            return Q4KLinear(tiles, end - start, in_features=head.in_features)

        self._first, self._rest = part(0, narrow_end), part(narrow_end, tail_start)
        self._tail = part(tail_start, head.out_features)
        self.narrow_first = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] float32 -> [..., out] float32
        if not self.narrow_first:
            return self.head(x)
        rows = x.reshape(-1, self.in_features)
        out = torch.empty(rows.shape[0], self.out_features)
        first, tail = out[:, : self.narrow_end], out[:, self.tail_start :]
        first.copy_(self._first(rows))
        tail.copy_(self._tail(rows))
        # The top probability over the narrow ids: 1 / sum(exp(z - max)), over both parts.
        peak = torch.maximum(first.amax(dim=1), tail.amax(dim=1)).unsqueeze(1)
        total = (first - peak).exp_().sum(dim=1) + (tail - peak).exp_().sum(dim=1)
        unsure = ~(total <= 1.0 / self.sure)  # a NaN row is scored whole, NaN as the whole layer gives it
        rest = out[:, self.narrow_end : self.tail_start]
        rest.fill_(float("-inf"))
        if bool(unsure.any()):
            rest[unsure] = self._rest(rows[unsure])
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, first [0, {self.narrow_end}) "
            f"and [{self.tail_start}, {self.out_features}), the rest where the top probability < {self.sure}"
        )


def first_added_id(tokenizer: object) -> int:
    """The lowest id ``tokenizer`` added to its learnt vocabulary (transformers' ``added_tokens_decoder``:
    chat markers, end of text), or its length where it added none."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return min(added, default=len(tokenizer))  # type: ignore[arg-type]


def narrow_first_head(model: torch.nn.Module, first_added_id: int) -> bool:
    """Give ``model`` (a draft on the Q4_K kernels) a :class:`NarrowFirstHead`, its tokenizer's added ids
    from ``first_added_id`` on; whether it did. A head of another kind is left as it is, and so is one
    whose other ids are fewer than those scored first: skipping them then saves less than half the layer
    for the same check and extra call (measured only where they are the larger part: Qwen's 86,080 of
    151,936)."""
    head = model.get_output_embeddings()
    if type(head) is not Q4KLinear or head.bias is not None:
        return False
    tail_start = min(first_added_id, head.out_features) // TILE * TILE
    narrow = NARROW_IDS + head.out_features - tail_start
    if tail_start <= NARROW_IDS or tail_start - NARROW_IDS < narrow:
        return False
    model.set_output_embeddings(NarrowFirstHead(head, NARROW_IDS, tail_start))
    return True
