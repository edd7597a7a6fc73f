"""A KV cache written by position: appends write in place, rollback sets a length, nothing is copied.

transformers' ``DynamicLayer`` appends with ``torch.cat``, which copies the layer's whole cache on every
forward: with the draft model's one-token forwards that is a full copy per drafted token (measured
~7.6 ms per append at 2,048 positions on the reference CPU). Here each full-attention layer keeps its keys
and values in buffers with spare room ([batch, kv_heads, capacity, head_dim]); an append writes the new
rows at the current length and the layer hands attention a view of the first ``length`` positions, so
attention still reads exactly the valid prefix. Buffers double when full (a handful of copies over a
long sequence, none once a request of that length has run, since :meth:`PositionLayer.reset` keeps them).

Only transformers' public cache API is used, so the range of transformers versions marspec supports can
be wide: a :class:`transformers.Cache` built from a list of layers (its public constructor), whose
full-attention layers are :class:`PositionLayer`, an implementation of the public layer interface
:class:`transformers.CacheLayerMixin` (``update``, ``get_seq_length``, ``get_mask_sizes``,
``get_max_length``, ``crop``, ``reset``, and the ``keys``/``values`` views). A layer never depends on
transformers calling anything but ``update``; it owns its state (buffers and a length) and keeps the
interface's ``keys``, ``values`` and ``is_initialized`` attributes truthful for whoever reads them.
"""

from __future__ import annotations

import torch
from transformers import Cache, CacheLayerMixin, DynamicCache, DynamicLayer, PreTrainedConfig

from marspec.backends.row_attention import ROW_ATTENTION

INITIAL_CAPACITY = 256  # positions; doubled as needed


class PositionLayer(CacheLayerMixin):
    """One full-attention layer's keys and values in growable buffers; ``keys``/``values`` are views of
    the valid prefix ([batch, kv_heads, length, head_dim])."""

    is_sliding = False  # attends to every cached position (masks read this)
    is_croppable = True  # crop() restores exactly the earlier state

    def __init__(self, kv_dtype: torch.dtype | None = None) -> None:
        """``kv_dtype``: what the buffers hold (states are rounded to it when written); None: the states'
        own dtype."""
        super().__init__()
        self.kv_dtype = kv_dtype
        self.length = 0
        self._key_buf: torch.Tensor | None = None  # [B, H, capacity, D]
        self._value_buf: torch.Tensor | None = None

    # The interface's keys and values: views of the cached positions, made when read (a forward writes
    # and a rollback crops every layer, and most never read them: two views a layer were ~1.5% of a
    # draft step). transformers' base class sets both to None when it makes a layer.
    @property
    def keys(self) -> torch.Tensor | None:
        """The cached keys [B, H, length, D] (a view of the buffer), or None before any."""
        return None if self._key_buf is None else self._key_buf[:, :, : self.length]

    @keys.setter
    def keys(self, value: None) -> None:
        _only_none(value, "keys")

    @property
    def values(self) -> torch.Tensor | None:
        """The cached values [B, H, length, D] (a view of the buffer), or None before any."""
        return None if self._value_buf is None else self._value_buf[:, :, : self.length]

    @values.setter
    def values(self, value: None) -> None:
        _only_none(value, "values")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Make buffers for states shaped like these (an empty sequence); transformers' early
        initialisation calls this, and :meth:`update` does the same on its own when needed."""
        self._new_sequence(key_states, value_states, 0)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key_states``/``value_states`` ([B, H, n, D]) at positions ``length ... length + n`` and
        return views of every cached position, these included."""
        start = self.length
        n = key_states.shape[-2]
        key_buf, value_buf = self.room(key_states, value_states, n)
        key_buf[:, :, start : start + n].copy_(key_states)
        value_buf[:, :, start : start + n].copy_(value_states)
        self.advance(n)
        return self.keys, self.values

    def room(
        self, key_states: torch.Tensor, value_states: torch.Tensor, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers ([B, H, capacity, D]) with room for ``n`` positions after the cached
        ones, made or grown as an append of states like these needs (only their batch size, heads, head
        size, dtype and device are read). Write positions ``length .. length + n - 1``, then
        :meth:`advance`: what :meth:`update` does, for a writer of its own (a packed forward's kernel)."""
        start, end = self.length, self.length + n
        # The checks are kept off the per-token path: shapes are checked once per sequence, at its start.
        if start == 0 or self._key_buf is None or self._value_buf is None:
            return self._new_sequence(key_states, value_states, end)
        if end > self._key_buf.shape[-2]:
            return self._grow(end)
        return self._key_buf, self._value_buf

    def advance(self, n: int) -> None:
        """Count ``n`` positions written after the cached ones (see :meth:`room`)."""
        self.length += n

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) for a forward of ``query_length`` new tokens: the whole prefix plus them."""
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1  # grows without limit

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` positions (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to drop, got {tokens_to_remove}")
        if tokens_to_remove == 0 or self._key_buf is None:
            return
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        """A new sequence: the length goes to 0 and the buffers stay, ready for the next request."""
        self.length = 0

    def _new_sequence(
        self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Length 0 and buffers for states like these with room for ``needed`` positions: the current ones
        when they fit (the same batch size, heads, head size, dtype and device), else new ones."""
        self.length = 0
        key_buf, value_buf = self._key_buf, self._value_buf
        dtype = self.kv_dtype or key_states.dtype
        if key_buf is None or value_buf is None or not _fits(key_buf, key_states, dtype):
            key_buf = _alloc(key_states, max(needed, INITIAL_CAPACITY), dtype)
            value_buf = _alloc(value_states, max(needed, INITIAL_CAPACITY), dtype)
            self._key_buf, self._value_buf = key_buf, value_buf
            self.dtype, self.device = dtype, key_states.device
            self.is_initialized = True
        elif needed > key_buf.shape[-2]:
            key_buf, value_buf = self._grow(needed)
        return key_buf, value_buf

    def _grow(self, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Double the buffers' capacity until ``needed`` positions fit; the cached ones are kept."""
        assert self._key_buf is not None and self._value_buf is not None
        capacity = self._key_buf.shape[-2]
        while capacity < needed:
            capacity *= 2
        self._key_buf = _grown(self._key_buf, capacity, self.length)
        self._value_buf = _grown(self._value_buf, capacity, self.length)
        return self._key_buf, self._value_buf


def _only_none(value: object, name: str) -> None:
    if value is not None:
        raise AttributeError(f"a PositionLayer's {name} are a view of its buffers: write them with update()")


def _fits(buf: torch.Tensor, states: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        buf.shape[:2] == states.shape[:2]
        and buf.shape[-1] == states.shape[-1]
        and buf.dtype == dtype
        and buf.device == states.device
    )


def _alloc(like: torch.Tensor, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    batch, heads, _, dim = like.shape
    return torch.empty(batch, heads, capacity, dim, dtype=dtype, device=like.device)


def _grown(buf: torch.Tensor, capacity: int, length: int) -> torch.Tensor:
    """A copy of ``buf`` with room for ``capacity`` positions, its first ``length`` kept."""
    new = _alloc(buf, capacity, buf.dtype)
    new[:, :, :length].copy_(buf[:, :, :length])
    return new


def position_cache(config: PreTrainedConfig, kv_dtype: torch.dtype | None = None) -> Cache:
    """A transformers cache for ``config``'s model whose full-attention layers are :class:`PositionLayer`
    holding ``kv_dtype`` (None: the states' own dtype).

    The layer layout is the one ``DynamicCache(config=config)`` builds (public API); its plain
    full-attention layers are replaced and any other kind (sliding-window layers, which drop old
    positions) is kept as transformers makes it.
    """
    layout = DynamicCache(config=config).layers
    if getattr(config, "_attn_implementation", None) == ROW_ATTENTION:
        # Row-by-row attention windows each row itself: every layer keeps every position, so the cache
        # rolls back anywhere and a row sees the keys its one-token forward saw.
        return Cache(layers=[PositionLayer(kv_dtype) for _ in layout])
    layers = [PositionLayer(kv_dtype) if type(layer) is DynamicLayer else layer for layer in layout]
    return Cache(layers=layers)
