"""An EAGLE-3 head's cache at fixed shapes, so that a GPU replays its draft steps as CUDA graphs.

On a GPU a head step run eagerly is ~50 small kernels and their Python: 1.6-1.9 ms on an H200 at the
default target's width, half of a replayed target forward (docs/results.md, "On a GPU"), which leaves a
head little to gain. :class:`FixedHeadCache` is :class:`~marspec.drafters.eagle3_head.HeadCache`'s
counterpart on the fixed-shape path (:mod:`marspec.backends.fixed`): keys and values in one buffer of a
fixed capacity (doubled when full), rows written at slots computed on the device from a one-element
tensor holding the cache length, the mask built here on the device, and chain steps padded to the next
of :data:`~marspec.backends.fixed.QUERY_SIZES`. A chain step is then the same computation at the same
shape every time, captured once per size and replayed (checked bit for bit against the uncaptured step
at capture, :mod:`marspec.backends.graphs`). A padded row sits after the real ones, which never see it;
the head's linear layers and norms compute each row alone, so the real rows are what an unpadded step
gives. Token-tree steps (EAGLE-2's dynamic trees) run on the same buffers, uncaptured: their masks are
made per depth on the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from marspec.backends.fixed import QUERY_SIZES, capacity_for
from marspec.backends.graphs import GraphCache
from marspec.drafters.eagle3_head import Eagle3Head, TreeRows


class FixedHeadCache:
    """The head's keys and values for one sequence in fixed buffers (see the module's docstring); with
    ``graphs`` (CUDA only) each chain step size is captured once and replayed. Same interface as
    :class:`~marspec.drafters.eagle3_head.HeadCache`."""

    def __init__(self, head: Eagle3Head, graphs: bool = False) -> None:
        self.head = head
        weight = head.fc.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.graphs: GraphCache | None = GraphCache() if graphs else None
        self.length = 0
        self._capacity = 0
        self._keys = self._values = torch.empty(0, device=self.device)
        self._start = torch.zeros(1, dtype=torch.long, device=self.device)
        self._steps = torch.arange(QUERY_SIZES[-1], device=self.device)
        self._columns = torch.empty(0, dtype=torch.long, device=self.device)

    def rollback(self, length: int) -> None:
        self.length = min(self.length, length)

    def reset(self) -> None:
        self.length = 0

    @torch.inference_mode()
    def step(
        self, tokens: torch.Tensor, features: torch.Tensor, tree: TreeRows | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`HeadCache.step`: float32 draft logits [n, draft vocab] and the streams [n, hidden]
        of ``n`` more rows, appended to the cache."""
        n = int(tokens.shape[0])
        m = n if tree is not None else next((size for size in QUERY_SIZES if size >= n), n)
        if self.length + m > self._capacity:
            self._grow(self.length + m)
        self._start.fill_(self.length)
        if tree is not None:
            visible = torch.zeros(n, self._capacity, dtype=torch.bool, device=self.device)
            visible[:, : tree.sees.shape[1]] = tree.sees
            positions = torch.full((n,), tree.position, dtype=torch.long, device=self.device)
            out = self._rows(tokens, features, self._start, positions, visible)
        else:
            if m != n:
                tokens = torch.cat((tokens, tokens.new_zeros(m - n)))
                features = torch.cat((features, features.new_zeros(m - n, features.shape[1])))
            inputs = {"tokens": tokens, "features": features, "start": self._start}
            if self.graphs is not None and m <= QUERY_SIZES[-1]:
                out = self.graphs.run((m,), self._chain, inputs).clone()  # the next replay overwrites it
            else:
                out = self._chain(**inputs)
        self.length += n
        width = self.head.lm_head.out_features
        return out[:n, :width], out[:n, width:].to(self.dtype)

    def _grow(self, needed: int) -> None:
        capacity = capacity_for(self._capacity, needed)
        head = self.head
        shape = (1, head.num_kv_heads, capacity, head.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self._capacity:
            keys[:, :, : self.length] = self._keys[:, :, : self.length]
            values[:, :, : self.length] = self._values[:, :, : self.length]
        self._keys, self._values, self._capacity = keys, values, capacity
        self._columns = torch.arange(capacity, device=self.device)
        if self.graphs is not None:
            self.graphs.clear()  # they wrote into the old buffers

    def _chain(self, tokens: torch.Tensor, features: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """The captured step: ``m`` rows at positions ``start + 0 .. m - 1``, row i seeing every cached
        slot and rows 0..i. Every input is a device tensor of a fixed shape; nothing here reads the host."""
        m = tokens.shape[0]
        offsets = self._steps[:m] if m <= len(self._steps) else torch.arange(m, device=self.device)
        relative = self._columns - start  # [capacity]: a slot's index within this step's rows
        visible = relative[None, :] <= offsets[:, None]  # the cache, and this step's rows up to its own
        return self._rows(tokens, features, start, start + offsets, visible)

    def _rows(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        start: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """Rows written at slots ``start + 0 ..``, at ``positions`` (long[m]), each attending to the slots
        ``visible`` (bool[m, capacity]) allows; [m, draft vocab + hidden] float32: the draft logits and
        the streams side by side (one output buffer for a captured step)."""
        head = self.head
        m = tokens.shape[0]
        slots = start + (self._steps[:m] if m <= len(self._steps) else torch.arange(m, device=self.device))
        x, residual = head.layer_input(tokens.unsqueeze(0), features.unsqueeze(0))
        q, k, v = head.project(x, positions.unsqueeze(0))
        self._keys.index_copy_(2, slots, k)
        self._values.index_copy_(2, slots, v)
        attended = F.scaled_dot_product_attention(
            q, self._keys, self._values, attn_mask=visible[None, None], enable_gqa=True
        )
        stream = head.layer_output(attended, residual)
        return torch.cat((head.logits(stream)[0].float(), stream[0].float()), dim=-1)
