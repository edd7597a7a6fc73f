"""An EAGLE-3 head as a torch module: its parameters are named as in the published checkpoints
(``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), so a published head loads with
``load_state_dict`` and a trained one saves with ``state_dict``.

One step of the head at sequence position ``p`` reads the token at ``p + 1`` and a feature for ``p``
(``fc`` of the target's hidden states at ``p``, or, past what the target has scored, the head's own
output at ``p - 1``) and ranks the draft vocabulary for position ``p + 2``. Its decoder layer normalises
the token embedding (``input_layernorm``) and the feature (``hidden_norm``), attends over the two side by
side (2 x hidden wide), and adds the result to the feature (the residual stream); ``norm`` and
``lm_head`` turn the stream into draft logits, and the stream itself (before ``norm``) is the feature of
the next position. This is the layout vLLM's ``LlamaForCausalLMEagle3`` runs.

The pieces (:meth:`Eagle3Head.layer_input`, :meth:`Eagle3Head.project`, :meth:`Eagle3Head.layer_output`)
are separate so that inference (:class:`HeadCache`, with a position-written KV cache) and training
(:mod:`marspec.eagle3_training`, whose attention spans the training-time-test steps) share them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from marspec.backends.kv_cache import PositionLayer
from marspec.models.eagle3 import HeadSpec


class RMSNorm(nn.Module):
    """Llama's RMS norm: computed in float32, returned in the input's dtype."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Attention(nn.Module):
    def __init__(self, spec: HeadSpec, bias: bool) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.q_proj = nn.Linear(2 * h, spec.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(2 * h, spec.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(2 * h, spec.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(spec.num_heads * d, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, spec: HeadSpec) -> None:
        super().__init__()
        h, inter = spec.hidden_size, int(spec.config["intermediate_size"])
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Midlayer(nn.Module):
    def __init__(self, spec: HeadSpec, eps: float, bias: bool) -> None:
        super().__init__()
        h = spec.hidden_size
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.self_attn = _Attention(spec, bias)
        self.mlp = _MLP(spec)


class Eagle3Head(nn.Module):
    """The head's weights and its computation, position by position; no state between calls."""

    def __init__(self, spec: HeadSpec, feature_layers: int, embedding: nn.Module | None) -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        config = spec.config
        eps = float(config.get("rms_norm_eps", 1e-6))
        bias = bool(config.get("attention_bias", False)) and "midlayer.self_attn.q_proj.bias" in spec.shapes
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.norm_before_residual = bool(config.get("norm_before_residual", False))
        self.fc = nn.Linear(feature_layers * spec.target_hidden_size, spec.hidden_size, bias=False)
        self.midlayer = _Midlayer(spec, eps, bias)
        self.norm = RMSNorm(spec.hidden_size, eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(spec.vocab_size, dtype=torch.bool))
        if spec.has_embedding:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
            self._shared_embedding: list[nn.Module] = []
        else:  # the target's, held outside the module so it is neither saved nor trained with the head
            assert embedding is not None
            self._shared_embedding = [embedding]
        rope = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "eagle_config")}
        rope["head_dim"] = self.head_dim
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(**rope))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[n] token ids -> [n, hidden] embeddings (the head's own, else the target's)."""
        if self._shared_embedding:
            return self._shared_embedding[0](tokens)
        return self.embed_tokens(tokens)

    def target_ids(self) -> torch.Tensor:
        """long[draft vocab]: the target id of each draft id."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def layer_input(self, tokens: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layer's attention input ([..., 2 x hidden]: normed embedding, normed feature) and
        its residual stream ([..., hidden])."""
        layer = self.midlayer
        embeds = layer.input_layernorm(self.embed(tokens))
        normed = layer.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        return torch.cat((embeds, normed), dim=-1), residual

    def project(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of ``x`` ([B, n, 2 x hidden]) at ``positions`` ([B, n]), rotated:
        [B, heads, n, head_dim] and [B, kv_heads, n, head_dim] twice."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        attn = self.midlayer.self_attn
        b, n, _ = x.shape
        q = attn.q_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(v, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def layer_output(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The residual stream after the layer ([B, n, hidden]) from the attention's output ([B, heads, n,
        head_dim]): the next position's feature; :meth:`logits` of it rank the draft vocabulary."""
        layer = self.midlayer
        b, _, n, _ = attended.shape
        stream = residual + layer.self_attn.o_proj(attended.transpose(1, 2).reshape(b, n, -1))
        return stream + layer.mlp(layer.post_attention_layernorm(stream))

    def logits(self, stream: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the residual stream."""
        return self.lm_head(self.norm(stream))


@dataclass(frozen=True)
class TreeRows:
    """Where rows of a token tree's one depth stand: all at ``position``, each attending to what its row
    of ``sees`` (bool[n, cached + n]) allows: the sequence, its own ancestors' rows and itself."""

    position: int
    sees: torch.Tensor


class HeadCache:
    """The head's keys and values by position for one sequence (appends write in place, a rollback sets a
    length: :class:`marspec.backends.kv_cache.PositionLayer`)."""

    def __init__(self, head: Eagle3Head) -> None:
        self.head = head
        self.layer = PositionLayer()

    @property
    def length(self) -> int:
        return self.layer.length

    def rollback(self, length: int) -> None:
        self.layer.crop(min(0, length - self.layer.length))

    def reset(self) -> None:
        self.layer.reset()

    @torch.inference_mode()
    def step(
        self, tokens: torch.Tensor, features: torch.Tensor, tree: TreeRows | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the head on ``n`` more rows (``tokens``: long[n], the token after each row's position;
        ``features``: [n, hidden]), appended to the cache; returns float32 draft logits [n, draft vocab]
        and the streams [n, hidden] (each the next position's feature). The rows are the next ``n``
        positions of one sequence, each attending to every earlier one, or a token tree's ``tree``."""
        head = self.head
        start = self.layer.length
        n = int(tokens.shape[0])
        if tree is None:
            positions = torch.arange(start, start + n, device=tokens.device).unsqueeze(0)
        else:
            positions = torch.full((1, n), tree.position, dtype=torch.long, device=tokens.device)
        x, residual = head.layer_input(tokens.unsqueeze(0), features.unsqueeze(0))
        q, k, v = head.project(x, positions)
        keys, values = self.layer.update(k, v)
        mask = None if tree is None else tree.sees
        if mask is None and n > 1:  # row i sees the cache and the new positions up to its own
            mask = torch.ones(n, start + n, dtype=torch.bool, device=q.device).tril(start)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        stream = head.layer_output(attended, residual)
        return head.logits(stream)[0].float(), stream[0]


def load_head(
    spec: HeadSpec, feature_layers: int, embedding: nn.Module, dtype: torch.dtype, device: torch.device
) -> Eagle3Head:
    """The head's weights from its safetensors, in ``dtype`` on ``device``, for inference; the token
    embedding is ``embedding`` (the target's) unless the head has its own."""
    from safetensors.torch import load_file

    from marspec.errors import MarspecError, one_line

    state: dict[str, torch.Tensor] = {}
    try:
        for file in spec.files:
            for key, tensor in load_file(str(file)).items():
                state[key.removeprefix("model.")] = tensor
    except Exception as exc:
        raise MarspecError(
            f"cannot read EAGLE-3 head {spec.name!r}'s weights in {spec.folder} ({one_line(exc)})"
        ) from None
    head = Eagle3Head(spec, feature_layers, embedding)
    if "d2t" not in state:
        state["d2t"] = torch.zeros(spec.draft_vocab_size, dtype=torch.long)
    if "t2d" not in state:
        state["t2d"] = torch.zeros(spec.vocab_size, dtype=torch.bool).index_fill_(
            0, torch.arange(spec.draft_vocab_size) + state["d2t"].long(), True
        )
    state["d2t"] = state["d2t"].long()
    state["t2d"] = state["t2d"].bool()
    own = head.state_dict()
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise MarspecError(
            f"EAGLE-3 head {spec.name!r} has tensors marspec does not know ({', '.join(unknown[:3])}): it is "
            "not in the published Llama EAGLE-3 layout"
        )
    head.load_state_dict(state, strict=True)
    head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)
    head.rotary.float()  # rotary angles in float32 whatever the weights' dtype, as the target's are
    return head
