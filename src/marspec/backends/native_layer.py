"""A Llama-family decoder layer in native calls (``kernels/layer.cpp``): for a chain of rows on a cache of
buffers the whole layer in one (``layer_step``: keys and values into the cache, each row attended there),
else two around the caller's attention, ``layer_pre`` (input norm, q/k/v, each head's norms, rotation)
and ``layer_post`` (output projection, the outputs' norms, residuals, gated MLP). Where every layer of a
model steps so, one call runs them all (``layers_step``, :class:`NativeChain`).

:class:`~marspec.backends.direct.DirectForward` runs a layer through them where it can: Llama, Mistral,
Qwen2, Qwen3 and Gemma 3 layers whose linear layers are float ``torch.nn.Linear`` or the q4k engine's
Q4_K / Q6_K layers or int8 planes, their widths multiples of 16, when the kernels run here. Qwen3 and
Gemma 3 norm each head's query and key before the rotation; Gemma 3 also norms the attention's and the
MLP's outputs before their residuals, scales its norms by ``1 + w`` (given to the layer as that weight)
and gates its MLP with GELU's tanh form. One or two calls replace the ~150
operators a Python layer calls, a fifth of a one-token step on the q4k engine
(``benchmarks/step_profile.py``). Each row is computed alone in operations layer.cpp fixes (its own norm
and exp), so a row's bits do not depend on the other rows of a forward (strict decoding reproduces plain
decoding) or on the kernel path; they are not transformers' bits, which the Python layer keeps
(``DirectForward.native_layers = False``); ``tests/test_native_layer.py`` holds the two within float error.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from marspec.backends import kernels
from marspec.backends.int8_planes import Int8PlanesLinear
from marspec.backends.q4k import Q4KLinear
from marspec.backends.q6k import Q6KLinear
from marspec.backends.row_attention import layer_window

# The model types whose layers layer.cpp writes out (separate q/k/v and gate/up layers, transformers'
# RMSNorm and rotary embedding): the Llama layer, with each head's norms (Qwen3), and Gemma 3's.
GEMMA = "gemma3_text"  # Gemma 3's text model type
NATIVE_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3", GEMMA})
_DENSE, _Q4K, _Q6K, _PLANES = 0, 1, 2, 3
# The MLP gates layer.cpp computes, by transformers' activation name.
_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


class _Linears(NamedTuple):
    """Linear layers as layer.cpp takes them: (weights, kinds, out_features, pads, biases) lists."""

    weights: list[torch.Tensor]
    kinds: list[int]
    outs: list[int]
    pads: list[int]
    biases: list[torch.Tensor | None]


def _linears(modules: tuple[torch.nn.Module, ...]) -> _Linears | None:
    """``modules`` as layer.cpp's arguments, or None if one is not a kind it calls."""
    specs = []
    for module in modules:
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32:
            specs.append((module.weight, _DENSE, module.out_features, 0, module.bias))
        elif type(module) is Q4KLinear:
            specs.append((module.blocks, _Q4K, module.out_features, module.pad, module.bias))
        elif type(module) is Q6KLinear:
            specs.append((module.blocks, _Q6K, module.out_features, 0, module.bias))
        elif type(module) is Int8PlanesLinear:
            specs.append((module.blocks, _PLANES, module.out_features, module.pad, module.bias))
        else:
            return None
    weights, kinds, outs, pads, biases = zip(*specs, strict=True)
    return _Linears(list(weights), list(kinds), list(outs), list(pads), list(biases))


class HeadNorms(NamedTuple):
    """Each head's query and key norm weights [D] before the rotation (Qwen3, Gemma 3; None: not
    normed) and their epsilon, as layer.cpp takes them."""

    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    eps: float = 0.0


class OutputNorms(NamedTuple):
    """The attention's and the MLP's output norm weights [H] before their residuals (Gemma 3; None: not
    normed) and their epsilon, as layer.cpp takes them."""

    attention: torch.Tensor | None = None
    mlp: torch.Tensor | None = None
    eps: float = 0.0


LLAMA_HEADS, LLAMA_OUTPUTS = HeadNorms(), OutputNorms()  # the Llama layer's: none
SILU = _ACTIVATIONS["silu"]


class NativeLayer:
    """One decoder layer's two native calls, their arguments bound once."""

    def __init__(
        self,
        input_norm: tuple[torch.Tensor, float],
        pre_mlp_norm: tuple[torch.Tensor, float],
        qkv: _Linears,
        o_mlp: _Linears,
        head_dim: int,
        head_norms: HeadNorms = LLAMA_HEADS,
        output_norms: OutputNorms = LLAMA_OUTPUTS,
        activation: int = SILU,
        window: int = 0,
    ) -> None:
        ops = kernels.ops()
        self._pre, self._post, self._step = ops.layer_pre, ops.layer_post, ops.layer_step
        self._input_norm, self._pre_mlp_norm = input_norm, pre_mlp_norm
        self._qkv, self._o_mlp, self._head_dim = qkv, o_mlp, head_dim
        self._head_norms, self._output_norms = head_norms, output_norms
        self.activation = activation  # the MLP's gate (:data:`_ACTIVATIONS`)
        # A sliding-window layer's window: each row attends its own last ``window`` positions (0: all).
        self.window = window
        self._all = _Linears(*(a + b for a, b in zip(qkv, o_mlp, strict=True)))  # q, k, v, o, gate, up, down
        kv_heads = qkv.outs[1] // head_dim
        # What a cache's room() reads of an append (batch, heads, head size, dtype), for layer_step's rows.
        self.kv_like = torch.empty(1, kv_heads, 0, head_dim)
        # layer_step attends with the attention kernel's core: its head sizes only.
        self.steps = head_dim % 16 == 0 and head_dim <= 256

    def pre(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [1, T, H] -> the rotated query and key and the value, each [1, heads, T, D]."""
        return self._pre(hidden, *self._input_norm, *self._qkv, cos, sin, self._head_dim, *self._head_norms)

    def post(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output [1, T, H] from its input and the attention's [1, T, heads, D]."""
        return self._post(
            hidden, attended, *self._pre_mlp_norm, *self._o_mlp, *self._output_norms, self.activation
        )

    def step(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        room: tuple[torch.Tensor, torch.Tensor, int],
        scale: float,
    ) -> torch.Tensor:
        """The whole layer in one call for a chain of rows hidden [1, T, H]: :meth:`pre`, the keys and
        values written into the cache buffers ``room`` = (keys, values [1, H_kv, capacity, D], the first
        row's position), each row attended over its prefix (a sliding-window layer: its window of it),
        :meth:`post`; the caller advances the cache."""
        keys, values, start = room
        return self._step(
            hidden,
            *self._input_norm,
            *self._pre_mlp_norm,
            *self._all,
            cos,
            sin,
            self._head_dim,
            keys,
            values,
            start,
            scale,
            *self._head_norms,
            *self._output_norms,
            self.activation,
            self.window,
        )


class NativeChain:
    """A decoder's layers, each a :class:`NativeLayer` that steps, in one native call for a chain of rows
    (``layers_step``: each layer as :meth:`NativeLayer.step`, the same bits), their arguments bound once."""

    def __init__(self, layers: list[NativeLayer]) -> None:
        self._step = kernels.ops().layers_step
        self._norms = (
            [layer._input_norm[0] for layer in layers],
            [layer._input_norm[1] for layer in layers],
            [layer._pre_mlp_norm[0] for layer in layers],
            [layer._pre_mlp_norm[1] for layer in layers],
        )
        # Each list the layers' in turn: every weight of layer 0, then of layer 1, ...; the kinds alike.
        parts = zip(*(layer._all for layer in layers), strict=True)
        self._linears = _Linears(*([item for layer in part for item in layer] for part in parts))
        # The families' norms, activations and windows, each field a list of the layers' in turn.
        self._family = [
            list(field)
            for norms in ("_head_norms", "_output_norms")
            for field in zip(*(getattr(layer, norms) for layer in layers), strict=True)
        ] + [[layer.activation for layer in layers], [layer.window for layer in layers]]
        self._head_dim = layers[0]._head_dim

    def step(
        self,
        hidden: torch.Tensor,
        rotations: tuple[list[torch.Tensor], list[torch.Tensor]],
        rooms: tuple[list[torch.Tensor], list[torch.Tensor], int],
        scale: float,
    ) -> torch.Tensor:
        """Every layer for a chain of rows hidden [1, T, H]: ``rotations`` = (each layer's cos, each one's
        sin), ``rooms`` = (each layer's key buffer, each one's value buffer, the first row's position in
        all of them); the caller advances the caches."""
        keys, values, start = rooms
        head, norms, linears, family = self._head_dim, self._norms, self._linears, self._family
        return self._step(hidden, *norms, *linears, *rotations, head, keys, values, start, scale, *family)


def native_chain(layers: list[NativeLayer | None]) -> NativeChain | None:
    """``layers`` (a decoder's, in order) as one :class:`NativeChain`, or None unless each is a native
    layer that steps, all of one head size."""
    native = [layer for layer in layers if layer is not None and layer.steps]
    if not native or len(native) != len(layers) or len({layer._head_dim for layer in native}) != 1:
        return None
    return NativeChain(native)


def norm_eps(module: torch.nn.Module) -> float | None:
    """A transformers RMSNorm's epsilon (``variance_epsilon`` or ``eps``), None if it names neither."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return None if eps is None else float(eps)


def _norm_weight(module: torch.nn.Module, gemma: bool) -> torch.Tensor:
    """The weight layer.cpp norms by for ``module``: its own (Llama's ``w * x / rms``), or ``1 + w``
    (Gemma's ``x / rms * (1 + w)``), float32."""
    return (1.0 + module.weight.detach().float()) if gemma else module.weight


def native_layer(layer: torch.nn.Module, config: object, head_dim: int) -> NativeLayer | None:
    """``layer`` (a transformers decoder layer of ``config``) as a :class:`NativeLayer`, or None where
    layer.cpp does not write it out or the kernels do not run here."""
    if config.model_type not in NATIVE_FAMILY:
        return None
    gemma = config.model_type == GEMMA
    activation = _ACTIVATIONS.get(getattr(config, "hidden_activation" if gemma else "hidden_act", None))
    attn, mlp = layer.self_attn, layer.mlp
    if activation is None or not hasattr(attn, "q_proj") or not hasattr(mlp, "gate_proj"):
        return None
    qkv = _linears((attn.q_proj, attn.k_proj, attn.v_proj))
    o_mlp = _linears((attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    if qkv is None or o_mlp is None or head_dim % 2 or not kernels.kernels_available():
        return None
    if any(width % 16 for width in (config.hidden_size, *qkv.outs, *o_mlp.outs)):  # layer.cpp's vectors
        return None
    pre_mlp = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
    head_norms = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
    output_norms = [layer.post_attention_layernorm, layer.post_feedforward_layernorm] if gemma else []
    input_eps, mlp_eps = norm_eps(layer.input_layernorm), norm_eps(pre_mlp)
    head_eps = {norm_eps(n) for n in head_norms if n is not None}
    output_eps = {norm_eps(n) for n in output_norms}
    # layer.cpp takes the head norms with one epsilon, and the output norms with one.
    if None in {input_eps, mlp_eps} | head_eps | output_eps or len(head_eps) > 1 or len(output_eps) > 1:
        return None
    if head_eps and head_dim % 16:  # a head normed as a vector of its own
        return None
    heads = LLAMA_HEADS
    if head_eps:
        q, k = (None if n is None else _norm_weight(n, gemma) for n in head_norms)
        heads = HeadNorms(q, k, head_eps.pop())
    outputs = LLAMA_OUTPUTS
    if output_eps:
        outputs = OutputNorms(*(_norm_weight(n, gemma) for n in output_norms), output_eps.pop())
    return NativeLayer(
        (_norm_weight(layer.input_layernorm, gemma), input_eps),
        (_norm_weight(pre_mlp, gemma), mlp_eps),
        qkv,
        o_mlp,
        head_dim,
        heads,
        outputs,
        activation,
        layer_window(attn) or 0,
    )
