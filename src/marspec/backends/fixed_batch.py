"""The fixed-shape path with a batch dimension: the forwards of several sequences as one forward of
[B, m] rows over fixed buffers, which a GPU replays as one CUDA graph per (batch bucket, query size).

:mod:`marspec.backends.fixed` runs one sequence; here each sequence owns a *slot*: row ``slot`` of every
layer's key and value buffers ([slots, kv_heads, capacity + SPILL, head_dim]). A batched forward covers
the slots ``0 .. B - 1``, B the next of :data:`BATCH_SIZES` above the highest slot that scores rows, each
slot's rows padded to the forward's query size m (the next of
:data:`~marspec.backends.fixed.QUERY_SIZES`). Everything that changes between steps reaches the forward
as a device tensor of a fixed shape: the tokens [B, m], each slot's cache length [B], which of its
forward's rows each row sees [B, m, m] (a chain's or a token tree's) and the rows' position offsets
[B, m]. Keys and values are scattered at each slot's own positions; the mask, built on the device, lets
a row see its slot's cached positions and the rows of its own forward that it may see, never another
slot's. A slot with nothing to score in a forward (free, or between sequences) writes its padded rows
into SPILL positions past the capacity, which no real row sees, so its cache is left as it was.

Exactness: a row's keys and queries never meet another slot's, but the products of a batched forward
may round by the batch (a GPU's bf16 or fp32 matrix products choose kernels by their sizes; so does the
CPU's SDPA by its row count), so a sequence's logits can differ from its solo forward's in the last
bits, and greedy decoding can then differ where the target's top two nearly tie.
:func:`marspec.batch.scheduler.batching_note` says so where a user chooses to batch on this path; the
CPU's int8 and 4-bit engines batch on the eager path (:mod:`marspec.backends.packed`), exactly.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import Cache

from marspec.backends.fixed import (
    QUERY_SIZES,
    FixedShapeLM,
    SlotIndex,
    SlotLayer,
    bucket,
    capacity_for,
    kv_layout,
)
from marspec.backends.graphs import GraphCache
from marspec.interfaces import DraftTree

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)  # batch buckets captured; more slots run at their own count
SPILL = QUERY_SIZES[-1]  # positions past the capacity where a slot without rows writes its padded ones

HIDDEN_STATES_REFUSAL = (
    "an EAGLE-3 head on the fixed-shape path drafts for one sequence at a time: decode with max_batch=1 "
    "(--max-batch 1), or draft with a draft model or n-gram lookup"
)


@dataclass(frozen=True)
class SlotRows:
    """One slot's rows in a batched forward: ``tokens`` (long[n]) appended after its ``start`` cached
    positions as a chain, or a token ``tree`` (then ``tokens`` is the root followed by the tree's)."""

    slot: int
    start: int
    tokens: torch.Tensor
    tree: DraftTree | None = None
    last_only: bool = False


class BatchSlotLayer(SlotLayer):
    """One layer's keys and values for every slot ([slots, kv_heads, capacity + SPILL, head_dim]); an
    update scatters the forward's rows at their slots' positions (``index``: long[B, m]) and hands
    attention the buffers of the forward's B slots (the mask hides what a row may not see)."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index = self._slots.index
        assert index is not None, "a batch slot layer is written only inside FixedBatch's forward"
        rows = key_states.shape[0]
        where = index[:, None, :, None].expand_as(key_states)  # [B, kv_heads, m, head_dim]
        keys, values = self.keys[:rows], self.values[:rows]
        if key_states.dtype != keys.dtype:  # an fp16 cache asked for: rounded as SlotLayer rounds
            key_states, value_states = key_states.to(keys.dtype), value_states.to(values.dtype)
        keys.scatter_(2, where, key_states)
        values.scatter_(2, where, value_states)
        return keys, values


class FixedBatch:
    """A model's forwards for many sequences at once, on fixed buffers (see the module's docstring).

    ``base`` is the model on the one-sequence fixed-shape path; its model is shared, not copied, and
    graphs are captured here where ``base`` captures its own. Made once per model
    (:func:`shared_batch`), so its buffers and graphs serve every batch of sequences that follows. A
    sequence view holds a slot (:meth:`claim`, :meth:`release`); the host keeps each slot's length.
    """

    def __init__(self, base: FixedShapeLM) -> None:
        self.model = base.model
        self.name = base.name
        self.device, self.dtype, self.kv_dtype = base.device, base.dtype, base.kv_dtype
        self.graphs: GraphCache | None = GraphCache() if base.graphs is not None else None
        config = base.model.config
        self._layers = int(config.num_hidden_layers)
        self._kv_heads, self._head_dim = kv_layout(config)
        self._cache_keyword = base._cache_keyword
        self._positions = SlotIndex()
        self._cache: Cache | None = None
        self._slots = 0  # the buffers' slot rows
        self._capacity = 0  # the buffers' positions, SPILL not counted
        self._taken: set[int] = set()
        self._columns = torch.empty(0, dtype=torch.long, device=self.device)
        self._steps = torch.arange(QUERY_SIZES[-1], device=self.device)
        self._mask_min = torch.finfo(self.dtype).min
        self._chain_inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def claim(self) -> int:
        """A slot for a new sequence view: the lowest free one, so a forward's batch spans few slots."""
        slot = next(i for i in range(len(self._taken) + 1) if i not in self._taken)
        self._taken.add(slot)
        return slot

    def release(self, slot: int) -> None:
        """Give ``slot`` back (its view is done with; what it cached is dropped)."""
        self._taken.discard(slot)

    @torch.inference_mode()
    def move(self, slot: int, src: int, dst: int) -> None:
        """Copy ``slot``'s cached position ``src`` to ``dst`` in every layer (a token tree's kept path)."""
        assert self._cache is not None
        for layer in self._cache.layers:
            layer.keys[slot, :, dst] = layer.keys[slot, :, src]
            layer.values[slot, :, dst] = layer.values[slot, :, src]

    @torch.inference_mode()
    def run(self, calls: Sequence[SlotRows]) -> list[torch.Tensor]:
        """Score every call's rows in one forward; float32 logits per call ([n, V], or [1, V] for the last
        row when ``last_only``), in call order. The host's cache lengths are the caller's to advance."""
        if len({call.slot for call in calls}) != len(calls):
            raise ValueError("a batched forward scores at most one call per slot")
        n_max = max(int(call.tokens.shape[0]) for call in calls)
        m = bucket(QUERY_SIZES, n_max)
        batch = bucket(BATCH_SIZES, max(call.slot for call in calls) + 1)
        self._ensure(batch, max(call.start for call in calls) + m)
        inputs = self._inputs(calls, batch, m)
        captured = self.graphs is not None and m <= QUERY_SIZES[-1] and batch <= BATCH_SIZES[-1]
        if captured:
            assert self.graphs is not None
            out = self.graphs.run((batch, m), self._forward_on_device, inputs)
        else:
            out = self._forward_on_device(**inputs)
        keep, sizes = [], []
        for call in calls:
            n = int(call.tokens.shape[0])
            first = call.slot * m + (n - 1 if call.last_only else 0)
            keep.extend(range(first, call.slot * m + n))
            sizes.append(1 if call.last_only else n)
        rows = torch.tensor(keep, device=self.device)
        # One gather for every call's rows, a copy of the replay's output buffer (the next replay writes it).
        logits = out.reshape(batch * m, -1).index_select(0, rows).float()
        return list(logits.split(sizes))

    def _inputs(self, calls: Sequence[SlotRows], batch: int, m: int) -> dict[str, torch.Tensor]:
        """The forward's device inputs: tokens [B, m], cache lengths [B], which rows each row sees [B, m,
        m], position offsets [B, m]. A chain's rows see the rows before them and sit at consecutive
        positions (made once per shape, on the device); a token tree's rows take its shape's layout; a
        padded row is as a chain's, and a slot without rows writes past the capacity (SPILL)."""
        starts = [self._capacity] * batch
        dest: list[int] = []
        trees = []
        for call in calls:
            starts[call.slot] = call.start
            dest.extend(range(call.slot * m, call.slot * m + int(call.tokens.shape[0])))
            if call.tree is not None:
                trees.append(call)
        sees, offsets = self._chains(batch, m)
        if trees:
            sees, offsets = sees.clone(), offsets.clone()
            for call in trees:
                assert call.tree is not None
                layout, n = call.tree.layout, int(call.tokens.shape[0])
                sees[call.slot, :n, :n] = ~layout.hidden
                offsets[call.slot, :n] = layout.position_offsets
        tokens = torch.zeros(batch * m, dtype=torch.long, device=self.device)
        tokens.index_copy_(
            0, torch.tensor(dest, device=self.device), torch.cat([call.tokens for call in calls])
        )
        return {
            "tokens": tokens.view(batch, m),
            "starts": torch.tensor(starts, device=self.device),
            "sees": sees,
            "offsets": offsets,
        }

    def _chains(self, batch: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's rows as a chain's: which rows each sees (bool[B, m, m]) and their position
        offsets (long[B, m]), made once per shape."""
        made = self._chain_inputs.get((batch, m))
        if made is None:
            sees = torch.ones(m, m, dtype=torch.bool, device=self.device).tril().expand(batch, m, m)
            offsets = self._arange(m).expand(batch, m)
            made = (sees.contiguous(), offsets.contiguous())
            if m <= QUERY_SIZES[-1]:
                self._chain_inputs[(batch, m)] = made
        return made

    def _forward_on_device(
        self, tokens: torch.Tensor, starts: torch.Tensor, sees: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """The captured computation: logits [B, m, V] in the model's dtype for ``tokens`` (long[B, m]),
        slot b's row i written at position ``starts[b] + i`` and placed at ``starts[b] + offsets[b, i]``,
        seeing slot b's positions before ``starts[b]`` and the rows ``sees[b, i]`` of its forward. Every
        input is a device tensor of a fixed shape; nothing here reads the host."""
        assert self._cache is not None
        batch, m = tokens.shape
        self._positions.index = starts[:, None] + self._arange(m)  # [B, m]
        relative = self._columns[None, :] - starts[:, None]  # [B, C]: a column's row in its slot's forward
        inside = (relative >= 0) & (relative < m)
        seen = sees.gather(2, relative.clamp(0, m - 1)[:, None, :].expand(batch, m, -1))  # [B, m, C]
        visible = (relative < 0)[:, None, :] | (inside[:, None, :] & seen)
        mask = torch.zeros(batch, 1, m, self._columns.shape[0], dtype=self.dtype, device=tokens.device)
        mask.masked_fill_(~visible[:, None], self._mask_min)
        out = self.model(
            input_ids=tokens,
            attention_mask=mask,  # 4D: transformers passes it through as it is
            position_ids=starts[:, None] + offsets,
            **{self._cache_keyword: self._cache},
            use_cache=True,
        )
        return out.logits

    def _arange(self, m: int) -> torch.Tensor:
        return self._steps[:m] if m <= len(self._steps) else torch.arange(m, device=self.device)

    def _ensure(self, slots: int, needed: int) -> None:
        """Buffers of at least ``slots`` slots and ``needed`` positions, what is cached kept; new
        buffers void the graphs, which wrote into the old ones."""
        if slots <= self._slots and needed <= self._capacity:
            return
        capacity = capacity_for(self._capacity, needed)
        slots = max(slots, self._slots)
        shape = (slots, self._kv_heads, capacity + SPILL, self._head_dim)
        old = self._cache
        layers = []
        for i in range(self._layers):
            keys = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            values = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            if old is not None:
                keys[: self._slots, :, : self._capacity] = old.layers[i].keys[:, :, : self._capacity]
                values[: self._slots, :, : self._capacity] = old.layers[i].values[:, :, : self._capacity]
            layers.append(BatchSlotLayer(keys, values, self._positions))
        self._cache = Cache(layers=layers)
        self._slots, self._capacity = slots, capacity
        self._columns = torch.arange(capacity + SPILL, device=self.device)
        if self.graphs is not None:
            self.graphs.clear()


# Each model's batched forwards, kept while its one-sequence backend lives: its buffers and graphs then
# serve every batch of sequences that follows (a generate_many call, a server's lifetime).
_SHARED: weakref.WeakKeyDictionary[FixedShapeLM, FixedBatch] = weakref.WeakKeyDictionary()


def shared_batch(lm: FixedShapeLM) -> FixedBatch:
    """The batched forwards of ``lm``'s model, made on first use and kept as long as ``lm``."""
    batch = _SHARED.get(lm)
    if batch is None:
        batch = _SHARED[lm] = FixedBatch(lm)
    return batch
