"""transformers' decoder forward for the CPU engines' Llama-family models, written out.

On this CPU, transformers' forward of the default draft (24 layers, one token) spends ~2.3 ms of its
~14 ms on its own plumbing beside the operators: module calls and their hooks, keyword arguments, the
mask and cache interfaces. The draft's one-token steps are most of what speculative decoding costs
here, so :class:`DirectForward` runs the same operators on the same tensors in the same order without
it: the model's own embedding, linear layers and rotary embedding are called as they are, the norms and
the rotation are transformers' formulas, and attention goes through the same function
(:func:`~marspec.backends.row_attention.row_by_row_attention`, or a packed batch's). Its logits and cache
entries are therefore transformers' bits (``tests/test_direct.py`` checks every architecture it takes).
A model's forwards all go one way (chains, token trees and packed batches alike), so the two are never
mixed within a sequence.

Only what the CPU engines run: float32 decoders of the families in :data:`FAMILY` with attention one
query row at a time. Beside the Llama decoder layer: Qwen3's and Gemma 3's norms of each head's queries
and keys, Phi-3's fused q/k/v and gate/up layers (one product, its output split: each output column is
its own sum, so the bits are those of separate layers), and Gemma 3's layer (its norms scale by
``1 + w``, four of them a layer, its embedding scaled, its local layers' own rotary frequencies and
sliding window). Another model (or Phi-3 with a partial rotary) keeps transformers' forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from marspec.backends.native_layer import (
    GEMMA,
    NativeChain,
    NativeLayer,
    native_chain,
    native_layer,
    norm_eps,
)
from marspec.backends.row_attention import ROW_ATTENTION

# The model types whose transformers forward is the one written out here.
FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", GEMMA})

# attend(attention module, query [1, H, T, D], key [1, H_kv, T, D], value [1, H_kv, T, D]) -> [1, T, H, D]:
# writes the keys and values into the cache and attends each row, as transformers' attention call does.
# An attend that can hand a native layer its cache's buffers for a chain of rows also has
# chain_room(module, rows, like) -> (keys, values, first position) or None, and advance(module, rows).
Attend = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _no_room(module: torch.nn.Module, rows: int, like: torch.Tensor) -> None:
    """An attend without cache buffers to hand out: every layer attends through it."""
    return None


Norm = Callable[[torch.Tensor], torch.Tensor]


class _Layer(NamedTuple):
    attention: torch.nn.Module  # passed to attend (its layer_idx, scaling and window)
    input_norm: Norm
    qkv: tuple[torch.nn.Module, ...]  # q, k, v; or one fused layer (Phi-3)
    sizes: tuple[int, int]  # the widths of q and of k (and v): a fused output's split
    q_norm: Norm | None  # each head's (Qwen3, Gemma 3)
    k_norm: Norm | None
    o: torch.nn.Module
    post_attention: Norm | None  # Gemma 3: on the attention's output
    pre_mlp: Norm
    gate_up: tuple[torch.nn.Module, ...]  # gate, up; or one fused layer (Phi-3)
    down: torch.nn.Module
    post_mlp: Norm | None  # Gemma 3: on the MLP's output
    act: Callable[[torch.Tensor], torch.Tensor]
    head_dim: int
    rotary: str | None  # Gemma 3: the layer type whose rotary frequencies it uses
    native: NativeLayer | None  # the layer's work around its attention in two native calls, where it runs


def direct_forward(model: PreTrainedModel) -> DirectForward | None:
    """The direct forward of ``model``, or None where it is not one this module writes out (another
    architecture, weights that are not float32, attention other than row by row)."""
    config = model.config
    if config.model_type not in FAMILY or getattr(config, "_attn_implementation", None) != ROW_ATTENTION:
        return None
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return None
    decoder = model.get_decoder()
    norms = [m for m in decoder.modules() if type(m).__name__.endswith("RMSNorm")]
    if any(norm.weight.dtype != torch.float32 or norm_eps(norm) is None for norm in norms):
        return None
    return DirectForward(model)


def fallback_note(model: PreTrainedModel, name: str, engine: str) -> str | None:
    """The line a user reads when a target on a CPU engine (``engine``: "q4k", "int8", "int4") gets no
    direct forward and runs through transformers' forward (the same answers, more time a step); None
    when it gets one."""
    if direct_forward(model) is not None:
        return None
    return (
        f"marspec: {name} ({model.config.model_type}) runs on the {engine} engine through transformers' "
        f"forward: marspec's direct forward takes {', '.join(sorted(FAMILY))} (the same tokens, slower steps)"
    )


def _norm(module: torch.nn.Module, gemma: bool) -> Norm:
    """transformers' RMSNorm of ``module`` in float32: the Llama family's ``w * x / rms``, Gemma's
    ``x / rms * (1 + w)``."""
    eps = norm_eps(module)
    assert eps is not None
    if gemma:
        scale = 1.0 + module.weight.float()  # what Gemma3RMSNorm computes at each call

        def gemma_norm(hidden: torch.Tensor) -> torch.Tensor:
            return hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps) * scale

        return gemma_norm
    weight = module.weight

    def llama_norm(hidden: torch.Tensor) -> torch.Tensor:
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return weight * (hidden * torch.rsqrt(variance + eps))

    return llama_norm


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding of ``x`` [1, heads, T, D] (``rotate_half``'s halves swapped)."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def _layer(layer: torch.nn.Module, config: object) -> _Layer:
    gemma = config.model_type == GEMMA
    attn, mlp = layer.self_attn, layer.mlp
    head_dim = int(attn.head_dim)
    kv = int(config.num_key_value_heads) * head_dim
    q = int(config.num_attention_heads) * head_dim
    fused_qkv = hasattr(attn, "qkv_proj")
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    return _Layer(
        attention=attn,
        input_norm=_norm(layer.input_layernorm, gemma),
        qkv=(attn.qkv_proj,) if fused_qkv else (attn.q_proj, attn.k_proj, attn.v_proj),
        sizes=(q, kv),
        q_norm=None if q_norm is None else _norm(q_norm, gemma),
        k_norm=None if k_norm is None else _norm(k_norm, gemma),
        o=attn.o_proj,
        post_attention=_norm(layer.post_attention_layernorm, gemma) if gemma else None,
        pre_mlp=_norm(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm, gemma),
        gate_up=(mlp.gate_up_proj,) if hasattr(mlp, "gate_up_proj") else (mlp.gate_proj, mlp.up_proj),
        down=mlp.down_proj,
        post_mlp=_norm(layer.post_feedforward_layernorm, gemma) if gemma else None,
        act=getattr(mlp, "act_fn", None) or mlp.activation_fn,
        head_dim=head_dim,
        rotary=getattr(attn, "layer_type", None) if gemma else None,
        native=native_layer(layer, config, head_dim),
    )


class DirectForward:
    """A decoder's forward over one row sequence (see the module)."""

    def __init__(self, model: PreTrainedModel) -> None:
        decoder = model.get_decoder()
        config = model.config
        self._embed = decoder.embed_tokens  # Gemma's scales its vectors itself
        self._rotary = decoder.rotary_emb
        self._final_norm = _norm(decoder.norm, config.model_type == GEMMA)
        self._head = model.get_output_embeddings()
        self._layers = [_layer(layer, config) for layer in decoder.layers]
        self._rotary_kinds = sorted({layer.rotary for layer in self._layers}, key=str)
        self._chain = _chain_of(self._layers)
        # Each layer through its native calls where it has them (False: the Python layer, for comparisons),
        # and all of them in one call where each steps alike (False: a call a layer, for comparisons).
        self.native_layers = True
        self.one_call = True

    def __call__(
        self,
        tokens: torch.Tensor,  # long[T]
        positions: torch.Tensor,  # long[T]
        attend: Attend,
        keep: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """float32 logits of the rows ``keep`` selects ([T, V] for None, the last row for 1, the rows a
        long tensor lists), every layer's keys and values handed to ``attend``."""
        hidden = self._embed(tokens.unsqueeze(0))  # [1, T, H]
        rotations = {}
        for kind in self._rotary_kinds:
            args = (
                (hidden, positions.unsqueeze(0)) if kind is None else (hidden, positions.unsqueeze(0), kind)
            )
            cos, sin = self._rotary(*args)  # [1, T, D]
            rotations[kind] = (cos.unsqueeze(1), sin.unsqueeze(1))
        rows = int(tokens.shape[0])
        chain_room = getattr(attend, "chain_room", _no_room)
        rooms = self._chain_rooms(chain_room, rows) if self.native_layers and self.one_call else None
        if rooms is not None:  # every layer in one call, its keys and values into the cache
            assert self._chain is not None
            each = [rotations[layer.rotary] for layer in self._layers]
            cos_sin = ([c for c, _ in each], [s for _, s in each])
            hidden = self._chain.step(hidden, cos_sin, rooms, self._layers[0].attention.scaling)
            for layer in self._layers:
                attend.advance(layer.attention, rows)  # type: ignore[attr-defined]
        else:
            hidden = self._each_layer(hidden, rotations, attend, chain_room)
        if isinstance(keep, int):
            hidden = hidden[:, -keep:]
        elif keep is not None:
            hidden = hidden[:, keep]
        return self._head(self._final_norm(hidden))[0]

    def _each_layer(
        self,
        hidden: torch.Tensor,
        rotations: dict[str | None, tuple[torch.Tensor, torch.Tensor]],
        attend: Attend,
        chain_room: Callable,
    ) -> torch.Tensor:
        """``hidden`` [1, T, H] through the layers one at a time: each in its native calls where it has
        them, else the Python layer."""
        rows = hidden.shape[1]
        for layer in self._layers:
            cos, sin = rotations[layer.rotary]
            if layer.native is not None and self.native_layers:
                room = chain_room(layer.attention, rows, layer.native.kv_like) if layer.native.steps else None
                if room is not None:  # the whole layer in one call, its keys and values into the cache
                    hidden = layer.native.step(hidden, cos, sin, room, layer.attention.scaling)
                    attend.advance(layer.attention, rows)  # type: ignore[attr-defined]
                    continue
                query, key, value = layer.native.pre(hidden, cos, sin)
                hidden = layer.native.post(hidden, attend(layer.attention, query, key, value))
                continue
            x = layer.input_norm(hidden)
            shape = (1, rows, -1, layer.head_dim)
            query, key, value = _qkv(layer, x)
            query, key, value = query.view(shape), key.view(shape), value.view(shape)
            if layer.rotary is None and layer.q_norm is not None:  # Qwen3: before the heads move
                query, key = layer.q_norm(query), layer.k_norm(key)
            query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
            if layer.rotary is not None:  # Gemma 3: after
                query, key = layer.q_norm(query), layer.k_norm(key)
            query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
            attended = attend(layer.attention, query, key, value)  # [1, T, H, D]
            out = layer.o(attended.reshape(1, rows, -1).contiguous())
            hidden = hidden + (out if layer.post_attention is None else layer.post_attention(out))
            out = _mlp(layer, layer.pre_mlp(hidden))
            hidden = hidden + (out if layer.post_mlp is None else layer.post_mlp(out))
        return hidden

    def _chain_rooms(
        self, chain_room: Callable, rows: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], int] | None:
        """Every layer's cache buffers with room for ``rows`` more positions, and the first of them, for
        :class:`NativeChain`; None where the layers do not run as one, or a layer has no buffers to give."""
        if self._chain is None:
            return None
        keys, values, starts = [], [], set()
        for layer in self._layers:
            assert layer.native is not None
            room = chain_room(layer.attention, rows, layer.native.kv_like)
            if room is None:
                return None
            keys.append(room[0])
            values.append(room[1])
            starts.add(room[2])
        return (keys, values, starts.pop()) if len(starts) == 1 else None


def _chain_of(layers: list[_Layer]) -> NativeChain | None:
    """The layers as one native call (:func:`native_chain`) where each steps natively with the same
    attention scale; else None."""
    if len({layer.attention.scaling for layer in layers}) != 1:
        return None
    return native_chain([layer.native for layer in layers])


def _qkv(layer: _Layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if len(layer.qkv) == 3:
        q, k, v = layer.qkv
        return q(x), k(x), v(x)
    q_size, kv_size = layer.sizes
    fused = layer.qkv[0](x)
    return fused[..., :q_size], fused[..., q_size : q_size + kv_size], fused[..., q_size + kv_size :]


def _mlp(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
    if len(layer.gate_up) == 2:
        gate, up = layer.gate_up
        return layer.down(layer.act(gate(x)) * up(x))
    gate, up = layer.gate_up[0](x).chunk(2, dim=-1)
    return layer.down(up * layer.act(gate))
