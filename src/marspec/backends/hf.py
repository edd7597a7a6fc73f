"""A Hugging Face transformers causal LM behind the backend protocol (marspec.interfaces.CausalLM)."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantLinear
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    DynamicCache,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.cache_utils import DynamicLayer

from marspec.backends.direct import Attend, DirectForward, direct_forward
from marspec.backends.kv_cache import PositionLayer, position_cache
from marspec.backends.row_attention import (
    ROW_ATTENTION,
    has_sliding_layers,
    layer_window,
    row_by_row_attention,
)
from marspec.backends.timing import ForwardTimer
from marspec.errors import MarspecError
from marspec.interfaces import DraftTree, ForwardClock

# The most tokens one forward scores where chunks change no bit (HFCausalLM.forward): it bounds a long
# prompt's activations (an 8,192-token prefill of the default target peaked 0.64 GiB above its loaded size
# in chunks of 512, 1.85 GiB in one forward: docs/results/long-prompts-2026-12-06.md). Each chunk reads
# the weights again (~1.3 GB for the default target), a small share of 512 rows' products; llama.cpp's
# default batch is also 512.
PREFILL_CHUNK = 512


def cache_keyword(model: PreTrainedModel) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` still works but warns that 5.40 removes it), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFCausalLM:
    """A transformers causal LM with a KV cache that is rolled back in place (a :class:`CausalLM`), which
    keeps chosen layers' hidden states on request (a :class:`HiddenStates`).

    The cache is written by position (:mod:`marspec.backends.kv_cache`): appends write in place and a
    rollback only sets a length. ``position_cache=False`` keeps transformers' ``DynamicCache``, which
    copies the whole cache on every append (for comparisons). ``kv_dtype`` sets what the position cache
    holds (None: the model's dtype; float16 halves its memory where the kernels attend the rows,
    :mod:`marspec.backends.row_attention`). Models the direct forward takes (:mod:`marspec.backends.direct`)
    run it unless :attr:`use_direct` is False (for comparisons; the same bits either way).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        name: str,
        position_cache: bool = True,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        # out_features, not weight.shape: a quantised head keeps its weight behind a method.
        self.vocab_size: int = int(model.get_output_embeddings().out_features)
        self.context_length: int = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        first = next(model.parameters())
        self.dtype: torch.dtype = first.dtype
        self.device: torch.device = first.device
        self.eos_token_ids: frozenset[int] = eos_token_ids(model, tokenizer)
        self.clock = ForwardClock()
        self._timer = ForwardTimer(self.device, self.clock)
        self.position_cache = position_cache
        self._kv_dtype = kv_dtype
        self._cache_keyword = cache_keyword(model)
        self._cache = self._new_cache()
        self._cached = 0
        # The token id at every cached position, so a new prompt can keep the prefix it shares with
        # what is cached (:meth:`keep_prefix`). Grown by doubling like the position cache.
        self._ids = torch.empty(256, dtype=torch.long, device=self.device)
        # Sliding-window layers drop old positions, so they cannot be rolled back to an arbitrary prefix.
        layer_types = (PositionLayer,) if position_cache else (DynamicLayer,)
        self._rolls_back_anywhere = all(type(layer) in layer_types for layer in self._cache.layers)
        self.hidden_size: int = int(model.config.hidden_size)
        self.num_layers: int = int(model.config.num_hidden_layers)
        self._states = _HiddenStateRecorder(model)
        self._direct: tuple[object, DirectForward | None] = (None, None)  # (attention it was made for, it)
        self.use_direct = True
        self.prefill_chunk: int | None = PREFILL_CHUNK  # None: every forward in one

    @property
    def cached_len(self) -> int:
        """Number of positions held in the KV cache."""
        return self._cached

    def reset(self) -> None:
        """Drop the cache (a new sequence starts); a position cache keeps its buffers for the next one."""
        # Only position layers are reset in place: a sliding-window layer's reset differs between
        # transformers versions (5.17 zeroes its tensors and keeps their length), so a cache that has one
        # is made anew. (A stale cache is made anew by the sequence's first forward.)
        if self.position_cache and all(isinstance(layer, PositionLayer) for layer in self._cache.layers):
            self._cache.reset()
        else:
            self._cache = self._new_cache()
        self._cached = 0

    @property
    def reuses_prefix(self) -> bool:
        """Whether :meth:`keep_prefix` can keep anything: a kept prefix must be what a fresh prefill would
        have cached, up to rounding. Not with sliding-window layers (they drop old positions), nor with
        dynamically quantised linears: they scale each forward's activations as a whole, so a prefix scored
        in other chunks differs beyond rounding (an int8 draft would then draft differently, and a lossy
        rule's output follows the drafts)."""
        return self._rolls_back_anywhere and not any(
            isinstance(module, DynamicQuantLinear) for module in self.model.modules()
        )

    def keep_prefix(self, ids: torch.Tensor) -> int:
        """Keep the longest cached prefix that equals the start of ``ids`` (long[n]) and drop the rest;
        return its length (0 after a reset when nothing matches or the cache cannot be rolled back).

        A cached position's keys and values depend only on the tokens up to it, so a kept prefix is
        what a fresh forward over those tokens would have cached (up to floating-point rounding: the
        prefix may have been computed in other chunks). One host read.
        """
        n = min(self._cached, int(ids.shape[0]))
        if not self.reuses_prefix or n == 0 or self._cache_stale():
            self.reset()
            return 0
        differs = self._ids[:n] != ids[:n].to(self._ids.device)  # bool[n]
        # The number of leading positions before the first difference.
        kept = int(torch.cumsum(differs, 0).eq(0).sum())
        if kept == 0:
            self.reset()
        else:
            self.rollback(kept)
        return kept

    def _record_ids(self, tokens: torch.Tensor) -> None:
        """Note ``tokens`` (long[n]) as the ids of the next ``n`` cache positions."""
        end = self._cached + int(tokens.shape[0])
        if end > self._ids.shape[0]:
            grown = torch.empty(max(end, 2 * self._ids.shape[0]), dtype=torch.long, device=self._ids.device)
            grown[: self._cached] = self._ids[: self._cached]
            self._ids = grown
        self._ids[self._cached : end] = tokens

    def note_appended(self, tokens: torch.Tensor) -> None:
        """Count ``tokens`` (long[n]), which a forward has just written into the cache's next ``n``
        positions: their ids, their hidden states when kept, the cached length. Every forward that writes
        this model's cache calls it once (a packed forward, :mod:`marspec.backends.packed`, for each
        sequence it served)."""
        self._record_ids(tokens)
        self._states.store(self._cached)
        self._cached += int(tokens.shape[0])

    @property
    def cache_layers(self) -> list:
        """The KV cache's layers (transformers' ``CacheLayerMixin`` objects), in layer order."""
        return self._cache.layers

    @property
    def captures_hidden_states(self) -> bool:
        """Whether forwards also keep some layers' hidden states (:meth:`capture_hidden_states`)."""
        return bool(self._states.layers)

    @property
    def direct(self) -> DirectForward | None:
        """The forward written out for this model (:mod:`marspec.backends.direct`) that every forward
        takes, or None where transformers' forward runs: another architecture or attention, hidden states
        kept (transformers' layers note them), or :attr:`use_direct` off."""
        if self.captures_hidden_states or not self.use_direct:
            return None
        # Made again when the model's attention changes (a quantiser switches it to row by row).
        attention = getattr(self.model.config, "_attn_implementation", None)
        if self._direct[0] != attention:
            self._direct = (attention, direct_forward(self.model))
        return self._direct[1]

    def _attend_cached(self, mask: torch.Tensor | None = None) -> Attend:
        """The direct forward's attention: each layer's new keys and values into this cache, each row
        attended as transformers' call to the row-by-row function does (``mask`` for a token tree)."""
        return _CachedAttend(self._cache.layers, mask)

    def _new_cache(self) -> DynamicCache:
        config = self.model.config
        self._cache_kind = self._kind_of_cache()
        if not self.position_cache:
            return DynamicCache(config=config)
        return position_cache(config, self._cache_kind[1])

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype this model's KV cache holds: the one asked for, else the model's."""
        return self._kv_dtype or self.dtype

    @kv_dtype.setter
    def kv_dtype(self, dtype: torch.dtype | None) -> None:
        """Ask for a dtype (None: the model's); it holds from the next sequence's start."""
        self._kv_dtype = dtype

    def _kind_of_cache(self) -> tuple[object, torch.dtype]:
        """What a cache made now would be made for: the model's attention and the keys' dtype."""
        return getattr(self.model.config, "_attn_implementation", None), self.kv_dtype

    def _cache_stale(self) -> bool:
        """Whether the model's attention (a quantiser switches it) or the dtype asked for changed since the
        cache was made."""
        return self._cache_kind != self._kind_of_cache()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append ``tokens`` (long[n], n >= 1) to the cache and return float32 logits.

        Returns [n, V] logits, or [1, V] for the last position only when ``last_only`` (a prefill does not
        need the LM head over the whole prompt: with V = 151,936 that head would dominate the cost).
        More than :attr:`prefill_chunk` tokens are scored in forwards of that many where that changes no
        bit (:meth:`chunks_exactly`), which bounds a long prompt's activations (:data:`PREFILL_CHUNK`);
        elsewhere in one forward.
        """
        start = self._timer.start()
        n, chunk = int(tokens.shape[0]), self.prefill_chunk
        if chunk is None or n <= chunk or not self.chunks_exactly():
            logits = self._forward_once(tokens, last_only)
        else:
            # With last_only, a chunk before the last runs the head over one row too (a row's cost), unread.
            parts = [self._forward_once(tokens[s : s + chunk], last_only) for s in range(0, n, chunk)]
            logits = parts[-1] if last_only else torch.cat(parts)
        self._timer.stop(start)
        return logits

    def chunks_exactly(self) -> bool:
        """Whether a forward scored in chunks gives every row and cache entry the bits of one forward:
        where rows are computed alone (:func:`rows_alone`)."""
        return rows_alone(self)

    def _forward_once(self, tokens: torch.Tensor, last_only: bool) -> torch.Tensor:
        if self._cached == 0 and self._cache_stale():  # a sequence's start, not every forward
            self._cache = self._new_cache()
        direct = self.direct
        if direct is not None:
            positions = torch.arange(self._cached, self._cached + tokens.shape[0], device=tokens.device)
            logits = direct(tokens, positions, self._attend_cached(), 1 if last_only else None)
        else:
            out = self.model(
                input_ids=tokens.unsqueeze(0),
                **{self._cache_keyword: self._cache},
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
            )
            logits = out.logits[0].float()  # [n or 1, V]
        self.note_appended(tokens)
        return logits

    @torch.inference_mode()
    def forward_tree(self, tree: DraftTree, root: torch.Tensor) -> torch.Tensor:
        """Score ``root`` (long[1]) and ``tree``'s nodes in one forward; returns float32 logits [N+1, V].

        Each node sits at the position of its depth and attends to the cache and its own ancestors only,
        so its row equals what a chain forward along its path would give. The cache then holds every
        node: :meth:`keep_path` must follow.
        """
        start = self._timer.start()
        cached = self._cached
        tokens = torch.cat((root, tree.tokens))  # [N+1]
        positions = cached + tree.position_offsets()  # [N+1]
        mask = tree.attention_mask(cached, self.dtype)
        direct = self.direct
        if direct is not None:
            logits = direct(tokens, positions, self._attend_cached(mask))
        else:
            out = self.model(
                input_ids=tokens.unsqueeze(0),
                attention_mask=mask,
                position_ids=positions.unsqueeze(0),
                **{self._cache_keyword: self._cache},
                use_cache=True,
            )
            logits = out.logits[0].float()  # [N+1, V]
        self.note_appended(tokens)
        self._timer.stop(start)
        return logits

    @torch.inference_mode()
    def keep_path(self, base: int, path: tuple[int, ...]) -> None:
        """After :meth:`forward_tree` with the root at position ``base``: keep the root and the nodes of
        ``path`` (node numbers, root-down) as positions ``base + 1 ...``; drop the rest of the tree.

        Chain nodes are already where they belong; only a node off the chain moves, one position per
        layer and tensor, so the compaction never copies the cache.
        """
        for i, node in enumerate(path, start=1):
            if node != i:
                src, dst = base + node, base + i
                for layer in self._cache.layers:
                    layer.keys[..., dst, :] = layer.keys[..., src, :]
                    layer.values[..., dst, :] = layer.values[..., src, :]
                self._ids[dst] = self._ids[src]
                self._states.move(src, dst)
        self.rollback(base + 1 + len(path))

    def capture_hidden_states(self, layers: tuple[int, ...]) -> None:
        """From the next forward on, also keep the hidden states of ``layers`` at every scored position
        (see :class:`marspec.interfaces.HiddenStates`). Layers asked for earlier stay kept, so drafters
        sharing this model each read theirs; asking for a new layer drops the cache (its positions have
        no states of that layer), asking again for kept ones changes nothing."""
        bad = [layer for layer in layers if not 0 <= layer <= self.num_layers]
        if bad:
            raise MarspecError(
                f"{self.name!r} has {self.num_layers} layers: hidden states can be read at layers 0 to "
                f"{self.num_layers}, not {', '.join(map(str, bad))}"
            )
        if not set(layers) <= set(self._states.layers):
            self.reset()
            self._states.capture(tuple(sorted(set(layers) | set(self._states.layers))))

    def hidden_states(self, start: int, end: int, layers: tuple[int, ...]) -> torch.Tensor:
        """The kept hidden states of ``layers`` at cached positions ``start .. end - 1``, side by side:
        [end - start, len(layers) x H]."""
        if not 0 <= start <= end <= self._cached:
            raise ValueError(f"positions {start}..{end} are not all cached ({self._cached} are)")
        return self._states.rows(start, end, layers)

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` cached positions."""
        drop = self._cached - length
        if drop < 0:
            raise ValueError(f"cannot roll back to {length}: only {self._cached} positions are cached")
        if drop:
            self._cache.crop(-drop)
            self._cached = length


def rows_alone(lm: HFCausalLM) -> bool:
    """Whether ``lm`` computes every row of a forward alone, so that its forwards can be split into chunks
    (:meth:`HFCausalLM.forward`, a batch's prefills) or those of several of its sequences packed into one
    (:mod:`marspec.backends.packed`) with every row's bits unchanged: its attention is the row-by-row form,
    which marspec switches on only for models whose linear layers are row-wise int8 or 4-bit; its cache is
    written by position; and it keeps no hidden states (a packed forward writes none)."""
    attention = getattr(lm.model.config, "_attn_implementation", None)
    return (
        attention == ROW_ATTENTION
        and not has_sliding_layers(lm.model.config)  # a packed forward attends whole prefixes
        and not lm.captures_hidden_states
        and all(isinstance(layer, PositionLayer) for layer in lm.cache_layers)
    )


class _HiddenStateRecorder:
    """Hidden states of chosen layers, kept by position in one buffer ([capacity, layers, H], grown by
    doubling like the position cache). Forward hooks note each forward's states; :meth:`store` writes them
    at the forward's positions. Nothing is hooked until :meth:`capture` names layers, so a model whose
    states nobody reads pays nothing."""

    def __init__(self, model: PreTrainedModel) -> None:
        self._model = model
        self.layers: tuple[int, ...] = ()  # sorted
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._seen: dict[int, torch.Tensor] = {}  # layer -> [n, H] of the latest forward
        self._buf: torch.Tensor | None = None

    def capture(self, layers: tuple[int, ...]) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._seen, self._buf = [], {}, None
        self.layers = layers
        decoder_layers = self._model.get_decoder().layers
        for layer in layers:
            # Layer i's input is layer i - 1's output; layer 0's is the embeddings' output.
            module = self._model.get_input_embeddings() if layer == 0 else decoder_layers[layer - 1]
            self._hooks.append(module.register_forward_hook(self._noter(layer)))

    def _noter(self, layer: int):
        def note(module: torch.nn.Module, args: object, output: torch.Tensor | tuple) -> None:
            states = output[0] if isinstance(output, tuple) else output  # [1, n, H]
            self._seen[layer] = states[0]

        return note

    def latest(self) -> torch.Tensor:
        """The latest forward's states, [n, layers, H], forgotten here (the caller writes them)."""
        rows = torch.stack([self._seen[layer] for layer in self.layers], dim=1)
        self._seen = {}
        return rows

    def store(self, start: int) -> None:
        """Write the latest forward's states at positions ``start ...`` (nothing when not capturing)."""
        if not self.layers:
            return
        rows = self.latest()  # [n, layers, H]
        end = start + rows.shape[0]
        buf = self._buf
        if buf is None or end > buf.shape[0] or buf.dtype != rows.dtype or buf.device != rows.device:
            capacity = max(end, 256, 2 * (0 if buf is None else buf.shape[0]))
            grown = rows.new_empty(capacity, *rows.shape[1:])
            if buf is not None and buf.dtype == rows.dtype and buf.device == rows.device:
                grown[: min(start, buf.shape[0])] = buf[: min(start, buf.shape[0])]
            buf = self._buf = grown
        buf[start:end] = rows

    def reserve(self, capacity: int, kept: int, dtype: torch.dtype, device: torch.device) -> bool:
        """A buffer of exactly ``capacity`` positions, the first ``kept`` rows kept, for a backend that
        writes the rows itself at slots it computes (:meth:`write_at`); returns whether the buffer was
        made anew (so memory that captured code wrote into is gone). Nothing when not capturing."""
        buf = self._buf
        if not self.layers or (buf is not None and buf.shape[:2] == (capacity, len(self.layers))):
            return False
        width = int(self._model.config.hidden_size)
        grown = torch.zeros(capacity, len(self.layers), width, dtype=dtype, device=device)
        if buf is not None and buf.shape[1] == len(self.layers):
            grown[:kept] = buf[:kept]
        self._buf = grown
        return True

    def write_at(self, index: torch.Tensor) -> None:
        """Write the latest forward's states at the positions ``index`` (long[n], on the device): no host
        read, no allocation beyond the stacked rows (:meth:`reserve` made the buffer)."""
        if self.layers:
            assert self._buf is not None, "reserve() the buffer before writing at slots"
            self._buf.index_copy_(0, index, self.latest().to(self._buf.dtype))

    def move(self, src: int, dst: int) -> None:
        if self._buf is not None:
            self._buf[dst] = self._buf[src]

    def rows(self, start: int, end: int, layers: tuple[int, ...]) -> torch.Tensor:
        missing = [layer for layer in layers if layer not in self.layers]
        if missing or self._buf is None:
            raise MarspecError(
                f"hidden states of layers {missing or list(layers)} are not kept: call "
                "capture_hidden_states(layers) first"
            )
        index = [self.layers.index(layer) for layer in layers]
        return self._buf[start:end, index].reshape(end - start, -1)  # [n, len(layers) x H]


# Grouped key/value heads under a mask. A verification forward scores several tokens, so transformers
# hands SDPA a mask, and with a mask its SDPA attention expands grouped key/value heads to every query
# head (repeat_kv: a copy of the layer's whole cache per forward) instead of letting SDPA group them. On
# this project's CPU grouping makes the attention of a 13-token verification 2-4x cheaper at 2-4k cached
# positions, with bit-identical outputs (docs/results.md, "Engine"). transformers' own switch for it is
# the process-wide TRANSFORMERS_SDPA_FORCE_GQA environment variable, which would change every other
# model in the process, and on CUDA it sends masked attention to the slow math kernel. So marspec
# registers its own attention under this name and switches only the models it loads onto the CPU.
GROUPED_SDPA = "marspec_grouped_sdpa"


def grouped_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, q, D]
    key: torch.Tensor,  # [B, H_kv, kv, D]
    value: torch.Tensor,  # [B, H_kv, kv, D]
    attention_mask: torch.Tensor | None,  # [B, 1, q, kv] or None
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except that a many-query forward with a mask lets SDPA group the
    key/value heads (``enable_gqa``) instead of expanding them; every other call is transformers' own.
    Returns [B, q, H, D] and no weights (transformers' attention-function signature)."""
    sdpa = AttentionInterface()["sdpa"]
    grouped = getattr(module, "num_key_value_groups", 1) > 1 and query.shape[2] > 1
    # What only transformers' function handles: then it decides, as for any model.
    special = any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "cache"))
    if attention_mask is None or not grouped or special or kwargs.get("output_attentions"):
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def use_grouped_attention(model: PreTrainedModel) -> bool:
    """Switch ``model`` from transformers' SDPA attention to :func:`grouped_sdpa_attention` (masks built
    as for SDPA); returns whether it did (a model on another attention is left as it is). This changes
    only ``model``; the name is registered with transformers on first use."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, AttentionMaskInterface()["sdpa"])
    model.set_attn_implementation(GROUPED_SDPA)
    return True


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every end-of-sequence id the checkpoint declares: its generation config (instruct models list
    their end-of-turn token there), its model config and its tokenizer."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


class _CachedAttend:
    """:meth:`HFCausalLM._attend_cached`'s attention over a cache's layers; for a chain of rows (no mask)
    on a layer of buffers that attends every position, it hands a native layer the buffers to write and
    attend in itself (:func:`marspec.backends.direct.Attend`)."""

    def __init__(self, layers: list, mask: torch.Tensor | None) -> None:
        self._layers, self._mask = layers, mask

    def __call__(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        keys, values = self._layers[module.layer_idx].update(key, value)
        window = layer_window(module)
        return row_by_row_attention(
            module, query, keys, values, self._mask, scaling=module.scaling, sliding_window=window
        )[0]

    def chain_room(
        self, module: torch.nn.Module, rows: int, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The key and value buffers of ``module``'s layer with room for ``rows`` more positions, and the
        first of them; None for a tree or a cache layer without buffers. (A sliding-window layer keeps
        every position too: the native layer attends each row's window in them.)"""
        layer = self._layers[module.layer_idx]
        if self._mask is not None or not isinstance(layer, PositionLayer):
            return None
        start = layer.length
        keys, values = layer.room(like, like, rows)
        return keys, values, start

    def advance(self, module: torch.nn.Module, rows: int) -> None:
        """Count the ``rows`` positions a native layer wrote into ``module``'s layer."""
        self._layers[module.layer_idx].advance(rows)
