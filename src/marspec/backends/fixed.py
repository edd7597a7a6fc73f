"""A fixed-shape backend: forwards of a few padded sizes over fixed buffers, which a GPU replays as CUDA
graphs.

On a GPU at batch one, an eager forward of the default pair's target costs 21-31 ms whatever it scores,
almost all of it the host launching ~1,000 kernels; its weights take 0.64 ms to read. Replaying a
captured graph launches them at once, but a graph replays fixed kernels on fixed memory, so every value
that changes between steps must reach it as a device tensor and every shape must repeat. Here:

- **the KV cache** is one buffer per layer of a fixed capacity (256 positions, doubled when full; the
  graphs are captured again for the new buffers). A forward writes its rows at slots computed on the
  device from a one-element tensor holding the cache length; a rollback only lowers the host's length,
  which the next forward writes into that tensor. Attention reads the whole buffer under a mask;
- **the mask** is built here on the device from the same tensor (transformers' mask preparation reads
  the host, which a graph cannot): a row sees the cached slots and the rows of its own forward that it
  may see (the earlier ones for a chain, its ancestors for a token tree);
- **forwards are padded** to the next of :data:`QUERY_SIZES` (1, 2, 4, ...; a verification of k + 1 =
  13 tokens runs at 16). Padded rows sit after the real ones, which never see them, and their logits
  are never returned. Longer forwards (prefills) run at their own size, uncaptured.

The rows that count are what the same forward gives without padding: a row's keys and queries never
meet a padded row. Where every row is also computed alone (oneDNN's prepacked linears, attention one
query row at a time) they are equal bit for bit, which ``tests/test_fixed.py`` checks on the CPU; SDPA's
CPU kernel rounds by the forward's row count on some CPUs (~2e-6 between 3 rows and 4 on an AMD EPYC),
as between any two forward lengths. At each capture :mod:`marspec.backends.graphs` checks replay
against the uncaptured forward bit for bit on the GPU. A model whose rows are not computed alone
(dynamically quantised int8 linears scale a whole forward's activations at once) is never padded. The
int8 and int4 targets compute rows alone, attention included (:mod:`marspec.backends.row_attention`), so
they are padded like any model; being CPU kernels they are never captured.

An EAGLE-3 head's feature layers (:class:`~marspec.interfaces.HiddenStates`) are kept in a buffer beside
the KV buffers, written inside the forward at the same device slots.

On a CPU (``graphs="on"``) the same path runs uncaptured, which is how these machines test it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantLinear
from transformers import Cache, CacheLayerMixin, PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from marspec.backends.graphs import GraphCache
from marspec.backends.hf import HFCausalLM
from marspec.errors import MarspecError
from marspec.interfaces import DraftTree

QUERY_SIZES = (1, 2, 4, 8, 16, 32)  # padded forward sizes; a longer forward runs at its own size
INITIAL_CAPACITY = 256  # cache positions; doubled when a forward would not fit
ATTENTIONS = ("sdpa", "eager", "marspec_grouped_sdpa", "marspec_row_by_row")  # take an additive 4D mask


def capacity_for(capacity: int, needed: int) -> int:
    """A fixed buffer's next capacity for ``needed`` positions: :data:`INITIAL_CAPACITY`, doubled until it
    fits (few sizes, so few captures)."""
    capacity = max(capacity, INITIAL_CAPACITY)
    while capacity < needed:
        capacity *= 2
    return capacity


def bucket(sizes: Sequence[int], n: int) -> int:
    """The smallest of ``sizes`` that holds ``n``, or ``n`` itself past the largest."""
    return next((size for size in sizes if size >= n), n)


def kv_layout(config: PreTrainedConfig) -> tuple[int, int]:
    """A model's key/value heads and head width, as its attention layers cache them."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(kv_heads), int(head_dim)


class SlotIndex:
    """The cache slots the running forward writes (long tensor on the device), shared by every layer."""

    index: torch.Tensor | None = None


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values in fixed buffers ([1, kv_heads, capacity, head_dim]); an update writes
    at the device slots of the running forward and hands attention the whole buffers (the mask hides the
    slots a row may not see)."""

    is_sliding = False
    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: SlotIndex) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._slots = slots

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The buffers exist from the start: nothing to do."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index = self._slots.index
        assert index is not None, "a slot layer is written only inside FixedShapeLM's forward"
        if key_states.dtype != self.keys.dtype:  # an fp16 cache asked for: rounded as every cache rounds
            key_states, value_states = key_states.to(self.keys.dtype), value_states.to(self.values.dtype)
        self.keys.index_copy_(2, index, key_states)
        self.values.index_copy_(2, index, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]  # not read on marspec's path (positions and masks are given)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class LengthOnlyCache:
    """A cache in fixed buffers whose length only the host keeps: a reset or a rollback copies nothing
    (positions past the length are written over by the next forward)."""

    _cached: int

    def reset(self) -> None:
        """Drop the cache (a new sequence); the buffers and graphs are kept for the next one."""
        self._cached = 0

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` cached positions (a length: nothing is copied)."""
        if length > self._cached:
            raise ValueError(f"cannot roll back to {length}: only {self._cached} positions are cached")
        self._cached = length


class FixedShapeLM(LengthOnlyCache, HFCausalLM):
    """An :class:`HFCausalLM` whose forwards run at fixed shapes (see the module's docstring); with
    ``graphs`` (CUDA only) each shape is captured once as a CUDA graph and replayed.

    The protocol is :class:`~marspec.interfaces.CausalLM`'s, so the decode loop is the same; what the
    host knows per step (the cache length, how many tokens a forward scores) chooses a shape and fills
    static inputs, and never enters the computation as a Python number.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        name: str,
        graphs: bool = False,
    ) -> None:
        check_fixed_shape(model)
        super().__init__(model, tokenizer, name)
        if graphs and self.device.type != "cuda":
            raise MarspecError(f"CUDA graphs need a CUDA device; {name!r} is on {self.device}")
        self.graphs: GraphCache | None = GraphCache() if graphs else None
        # Dynamically quantised linears scale a whole forward at once: a padded row would change the
        # real rows, so such a model runs every forward at its own size.
        self.pads = not any(isinstance(m, DynamicQuantLinear) for m in model.modules())
        config = model.config
        self._kv_heads, self._head_dim = kv_layout(config)
        self._slots = SlotIndex()
        self._start = torch.zeros(1, dtype=torch.long, device=self.device)  # the cache length, on the device
        self._steps = torch.arange(QUERY_SIZES[-1], device=self.device)
        self._capacity = 0
        self._columns = torch.empty(0, dtype=torch.long, device=self.device)
        self._fixed_cache: Cache | None = None
        self._chain_sees: dict[int, torch.Tensor] = {}
        self._tree_inputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._mask_min = torch.finfo(self.dtype).min

    # -- the cache ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def keep_path(self, base: int, path: tuple[int, ...]) -> None:
        """After :meth:`forward_tree` with the root at ``base``: keep the root and ``path``'s nodes as
        positions ``base + 1 ...`` (a node off the chain moves, one slot per layer and tensor)."""
        assert self._fixed_cache is not None
        for i, node in enumerate(path, start=1):
            if node != i:
                src, dst = base + node, base + i
                for layer in self._fixed_cache.layers:
                    layer.keys[..., dst, :] = layer.keys[..., src, :]
                    layer.values[..., dst, :] = layer.values[..., src, :]
                self._ids[dst] = self._ids[src]
                self._states.move(src, dst)
        self.rollback(base + 1 + len(path))

    def _ensure_capacity(self, needed: int) -> None:
        """Buffers (keys, values and the kept hidden states) for at least ``needed`` positions, the cached
        ones kept; new buffers void the graphs, which wrote into the old ones. A sequence's start gets
        buffers of another dtype if :attr:`kv_dtype` asks for one since."""
        retyped = (
            self._cached == 0
            and self._fixed_cache is not None
            and self._fixed_cache.layers[0].dtype != self.kv_dtype
        )
        grown = needed > self._capacity or retyped
        if grown:
            self._grow(needed)
        remade = self._states.reserve(self._capacity, self._cached, self.dtype, self.device)
        if (grown or remade) and self.graphs is not None:
            self.graphs.clear()

    def _grow(self, needed: int) -> None:
        capacity = capacity_for(self._capacity, needed)
        old = self._fixed_cache
        shape = (1, self._kv_heads, capacity, self._head_dim)
        layers = []
        for i in range(self.model.config.num_hidden_layers):
            keys = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            values = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            if old is not None:
                keys[:, :, : self._cached] = old.layers[i].keys[:, :, : self._cached]
                values[:, :, : self._cached] = old.layers[i].values[:, :, : self._cached]
            layers.append(SlotLayer(keys, values, self._slots))
        self._fixed_cache = Cache(layers=layers)
        self._capacity = capacity
        self._columns = torch.arange(capacity, device=self.device)

    # -- forwards ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append ``tokens`` (long[n]) to the cache; float32 logits [n, V], or [1, V] for the last
        position when ``last_only``. Runs padded to the next of :data:`QUERY_SIZES`."""
        n = int(tokens.shape[0])
        m = self._padded(n)
        return self._score(tokens, self._chain(m), self._arange(m), n, last_only)

    @torch.inference_mode()
    def forward_tree(self, tree: DraftTree, root: torch.Tensor) -> torch.Tensor:
        """Score ``root`` (long[1]) and ``tree``'s nodes in one forward, each node seeing the cache and
        its ancestors; float32 logits [N+1, V]. :meth:`keep_path` must follow."""
        n = len(tree) + 1
        m = self._padded(n)
        sees, offsets = self._tree(tree, m)
        return self._score(torch.cat((root, tree.tokens)), sees, offsets, n, last_only=False)

    def _padded(self, n: int) -> int:
        return bucket(QUERY_SIZES, n) if self.pads else n

    def _score(
        self,
        tokens: torch.Tensor,
        sees: torch.Tensor,
        offsets: torch.Tensor,
        n: int,
        last_only: bool,
    ) -> torch.Tensor:
        """Fill a forward's inputs at its padded size m = ``sees.shape[0]`` and run it (replayed when
        captured); return the ``n`` real rows' logits (or the last one's) as float32."""
        start = self._timer.start()
        m = int(sees.shape[0])
        self._ensure_capacity(self._cached + m)
        padded = tokens if m == n else torch.cat((tokens, tokens.new_zeros(m - n)))
        self._start.fill_(self._cached)
        inputs = {
            "tokens": padded,
            "start": self._start,
            "sees": sees,
            "offsets": offsets,
        }
        captured = self.graphs is not None and m <= QUERY_SIZES[-1]
        if last_only:
            inputs["keep"] = self._arange(n)[n - 1 :]
        elif m != n and not captured:
            inputs["keep"] = self._arange(n)  # uncaptured, the LM head skips the padded rows (~20% on a CPU)
        if captured:
            assert self.graphs is not None
            out = self.graphs.run((m, last_only), self._forward_on_device, inputs)
        else:
            out = self._forward_on_device(**inputs)
        self._record_ids(tokens)
        self._cached += n
        logits = out[:1] if last_only else out[:n]
        # A replay's output buffer is overwritten by the next replay: the caller gets its own copy.
        logits = logits.to(torch.float32, copy=True) if captured else logits.float()
        self._timer.stop(start)
        return logits

    def _forward_on_device(
        self,
        tokens: torch.Tensor,
        start: torch.Tensor,
        sees: torch.Tensor,
        offsets: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The captured computation: logits [m or 1, V] in the model's dtype for ``tokens`` (long[m])
        written at slots ``start + 0 .. m - 1``, row i at position ``start + offsets[i]``, seeing every
        slot before ``start`` and the rows ``sees[i]`` (bool[m, m]) of this forward; the hidden states
        of the kept layers (:meth:`capture_hidden_states`) are written at the same slots. Every input
        is a device tensor of a fixed shape; nothing here reads the host."""
        assert self._fixed_cache is not None
        m = tokens.shape[0]
        self._slots.index = start + self._arange(m)
        relative = self._columns - start  # [capacity]: a slot's index within this forward's rows
        inside = (relative >= 0) & (relative < m)
        seen = sees.gather(1, relative.clamp(0, m - 1).expand(m, -1))  # [m, capacity]
        visible = (relative < 0) | (inside & seen)
        mask = torch.zeros(m, self._capacity, dtype=self.dtype, device=start.device)
        mask.masked_fill_(~visible, self._mask_min)
        out = self.model(
            input_ids=tokens.unsqueeze(0),
            attention_mask=mask[None, None],  # 4D: transformers passes it through as it is
            position_ids=(start + offsets).unsqueeze(0),
            **{self._cache_keyword: self._fixed_cache},
            use_cache=True,
            logits_to_keep=keep if keep is not None else 0,
        )
        self._states.write_at(self._slots.index)  # an EAGLE-3 head's feature layers, when kept
        return out.logits[0]

    def _arange(self, m: int) -> torch.Tensor:
        """long[m]: 0 .. m - 1 on the device (a view of one tensor for the padded sizes)."""
        return self._steps[:m] if m <= len(self._steps) else torch.arange(m, device=self.device)

    def _chain(self, m: int) -> torch.Tensor:
        """bool[m, m]: row i of a chain sees rows 0..i (kept for the padded sizes)."""
        sees = self._chain_sees.get(m)
        if sees is None:
            sees = torch.ones(m, m, dtype=torch.bool, device=self.device).tril()
            if m <= QUERY_SIZES[-1]:
                self._chain_sees[m] = sees
        return sees

    def _tree(self, tree: DraftTree, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A tree shape's rows padded to ``m`` (made once per shape): which rows each sees (a padded row
        sees itself only) and each row's position offset (its depth; a padded row's its index)."""
        key = (tree.parents, tree.depths, m)
        made = self._tree_inputs.get(key)
        if made is None:
            n = len(tree) + 1
            layout = tree.layout
            sees = torch.eye(m, dtype=torch.bool, device=self.device)
            sees[:n, :n] = ~layout.hidden
            offsets = torch.arange(m, device=self.device)
            offsets[:n] = layout.position_offsets
            made = self._tree_inputs[key] = (sees, offsets)
        return made


def check_fixed_shape(model: PreTrainedModel) -> None:
    """Refuse a model the fixed-shape path cannot run, in one line: layers other than full attention (a
    sliding window drops positions a fixed buffer keeps), or an attention that ignores a 4D mask."""
    config = model.config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(config, "use_sliding_window", False):
        raise MarspecError(
            f"{type(model).__name__} has attention layers other than full attention "
            f"({', '.join(sorted(kinds))}): the fixed-shape path does not run it; use graphs='off'"
        )
    attention = getattr(config, "_attn_implementation", None)
    if attention not in ATTENTIONS:
        raise MarspecError(
            f"{type(model).__name__} uses {attention!r} attention, which the fixed-shape path does not "
            "run: load it with sdpa attention, or use graphs='off'"
        )


GRAPHS = ("auto", "on", "off")


def graphs_plan(graphs: str, device: torch.device) -> tuple[bool, bool]:
    """What ``graphs`` (one of :data:`GRAPHS`) means on ``device``: (take the fixed-shape path, capture
    its forwards as CUDA graphs). ``auto`` captures on CUDA and stays eager elsewhere: on the CPU the
    uncaptured fixed-shape path removes no launch cost worth having and adds work (attention over the
    whole buffer under a mask, padded rows); measured, strict decoding ~12% slower and plain the same
    (docs/results.md, "Fixed shapes on the CPU")."""
    if graphs not in GRAPHS:
        raise MarspecError(f"unknown graphs {graphs!r}: choose one of {', '.join(GRAPHS)}")
    cuda = device.type == "cuda"
    fixed = graphs == "on" or (graphs == "auto" and cuda)
    return fixed, fixed and cuda


def fixed_shape_lm(lm: HFCausalLM, graphs: bool) -> FixedShapeLM:
    """``lm``'s model behind the fixed-shape backend (``lm`` itself when it already is one with the same
    capture choice); ``lm`` is left as it was."""
    if isinstance(lm, FixedShapeLM) and (lm.graphs is not None) == graphs:
        return lm
    return FixedShapeLM(lm.model, lm.tokenizer, lm.name, graphs=graphs)
