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

Only what the CPU engines run: float32 decoders of the Llama family (``llama``, ``mistral``, ``qwen2``)
with attention one query row at a time (which refuses sliding windows,
:func:`~marspec.backends.row_attention.check_row_attention`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from marspec.backends.row_attention import ROW_ATTENTION

# The model types whose transformers forward is the one written out here (the same decoder layer).
FAMILY = frozenset({"llama", "mistral", "qwen2"})

# attend(attention module, query [1, H, T, D], key [1, H_kv, T, D], value [1, H_kv, T, D]) -> [1, T, H, D]:
# writes the keys and values into the cache and attends each row, as transformers' attention call does.
Attend = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _Layer(NamedTuple):
    attention: torch.nn.Module  # passed to attend (its layer_idx and scaling)
    input_norm: tuple[torch.Tensor, float]
    q: torch.nn.Module
    k: torch.nn.Module
    v: torch.nn.Module
    o: torch.nn.Module
    post_norm: tuple[torch.Tensor, float]
    gate: torch.nn.Module
    up: torch.nn.Module
    down: torch.nn.Module
    act: Callable[[torch.Tensor], torch.Tensor]
    head_dim: int


def direct_forward(model: PreTrainedModel) -> DirectForward | None:
    """The direct forward of ``model``, or None where it is not one this module writes out (another
    architecture, weights that are not float32, attention other than row by row)."""
    config = model.config
    if config.model_type not in FAMILY or getattr(config, "_attn_implementation", None) != ROW_ATTENTION:
        return None
    decoder = model.get_decoder()
    norms = [decoder.norm] + [
        n for layer in decoder.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    if any(norm.weight.dtype != torch.float32 or not hasattr(norm, "variance_epsilon") for norm in norms):
        return None
    return DirectForward(model)


def _norm(module: torch.nn.Module) -> tuple[torch.Tensor, float]:
    return module.weight, float(module.variance_epsilon)


def _rms_norm(hidden: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """transformers' RMSNorm of the Llama family, in float32."""
    weight, eps = norm
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return weight * (hidden * torch.rsqrt(variance + eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding of ``x`` [1, heads, T, D] (``rotate_half``'s halves swapped)."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


class DirectForward:
    """A Llama-family decoder's forward over one row sequence (see the module)."""

    def __init__(self, model: PreTrainedModel) -> None:
        decoder = model.get_decoder()
        self._embed = decoder.embed_tokens
        self._rotary = decoder.rotary_emb
        self._final_norm = _norm(decoder.norm)
        self._head = model.get_output_embeddings()
        self._layers = [
            _Layer(
                attention=layer.self_attn,
                input_norm=_norm(layer.input_layernorm),
                q=layer.self_attn.q_proj,
                k=layer.self_attn.k_proj,
                v=layer.self_attn.v_proj,
                o=layer.self_attn.o_proj,
                post_norm=_norm(layer.post_attention_layernorm),
                gate=layer.mlp.gate_proj,
                up=layer.mlp.up_proj,
                down=layer.mlp.down_proj,
                act=layer.mlp.act_fn,
                head_dim=int(layer.self_attn.head_dim),
            )
            for layer in decoder.layers
        ]

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
        cos, sin = self._rotary(hidden, positions.unsqueeze(0))  # [1, T, D]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rows = int(tokens.shape[0])
        for layer in self._layers:
            x = _rms_norm(hidden, layer.input_norm)
            shape = (1, rows, -1, layer.head_dim)
            query = _rotate(layer.q(x).view(shape).transpose(1, 2), cos, sin)
            key = _rotate(layer.k(x).view(shape).transpose(1, 2), cos, sin)
            value = layer.v(x).view(shape).transpose(1, 2)
            attended = attend(layer.attention, query, key, value)  # [1, T, H, D]
            hidden = hidden + layer.o(attended.reshape(1, rows, -1).contiguous())
            x = _rms_norm(hidden, layer.post_norm)
            hidden = hidden + layer.down(layer.act(layer.gate(x)) * layer.up(x))
        if isinstance(keep, int):
            hidden = hidden[:, -keep:]
        elif keep is not None:
            hidden = hidden[:, keep]
        return self._head(_rms_norm(hidden, self._final_norm))[0]
