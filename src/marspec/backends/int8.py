"""Int8 layers for the CPU engine: row-wise int8 linear layers, and an int8 token embedding.

:class:`RowwiseInt8Linear` holds int8 weights with one scale per output channel and quantises its input
with one scale per token row, chosen at run time. The integer product is summed exactly in int32 by
oneDNN's int8 kernel (VNNI or AMX on x86), so a row's output is the same bits whatever else is in the
forward: a 13-token verification scores each token exactly as plain decoding's one-token step does, and
costs about one such step (docs/results.md). :class:`Int8Embedding` keeps the token embedding in int8
too, with a scale per group of channels (about 0.28 of float32's bytes: the 1.5B Qwen's is 0.93 GB in
float32), so the model holds its vocabulary matrix, embedding and LM head, only in int8; a 4-bit draft
keeps its embedding in this form too (:func:`use_int8_embedding`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from marspec.backends.memory import release_pages

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# CPU features with an int8 dot product that sums into 32 bits. Without one, x86 int8 kernels add pairs
# of uint8 x int8 products in 16 bits, which saturates for activations near 255 against weights near
# 127: the products would be quietly wrong (the same way in every row, so strict would still equal plain).
_INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


INT8_UNAVAILABLE = (
    "int8 weights need oneDNN's int8 kernels and a CPU with an int8 dot product (x86 VNNI or AMX), which "
    "this torch build or CPU lacks: use target_quant='none' (or 'int4')"
)


@functools.cache
def rowwise_int8_available() -> bool:
    """Whether this torch build has oneDNN's int8 linear kernels and this CPU an int8 dot product that
    cannot saturate (x86 with VNNI or AMX; read from Linux's /proc/cpuinfo, so elsewhere: no)."""
    ops = torch.ops.onednn
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "qlinear_prepack")
        and hasattr(ops, "qlinear_pointwise")
    ):
        return False
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return any(flag in flags for flag in _INT8_DOT_FLAGS)


# The activations go in as uint8 around this zero point: oneDNN's x86 int8 kernels take unsigned inputs.
_ZERO_POINT = 128
# Floors for a row's largest magnitude: an all-zero row still gets a finite scale.
_TINY = torch.finfo(torch.float32).tiny
_PEAK_FLOOR = 1e-30


def int8_rows(weight: torch.Tensor, rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (float [out, in]) as int8 with one symmetric scale per row: (int8 [out, in], scale
    float32 [out]). A chunk of rows at a time, each chunk's pages handed back once it is converted: the
    1.5B target's LM head alone is 0.9 GB of fp32."""
    int8 = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], rows_per_chunk):
        chunk = weight[start : start + rows_per_chunk].float()  # [rows, in]
        peak = torch.maximum(chunk.amax(dim=1), chunk.amin(dim=1).neg())  # [rows]
        chunk_scale = (peak / 127.0).clamp_min(_TINY)
        int8[start : start + rows_per_chunk] = torch.div(chunk, chunk_scale[:, None]).round_()  # |q| <= 127
        scale[start : start + rows_per_chunk] = chunk_scale
        release_pages(weight[start : start + rows_per_chunk])
    return int8, scale


class RowwiseInt8Linear(torch.nn.Module):
    """``nn.Linear`` with int8 weights (one scale per output channel) and int8 activations (one scale per
    token row, chosen at run time), run by oneDNN (inference only).

    Each row is quantised on its own and the int8 product is summed exactly in int32, so a row's output
    does not depend on the other rows of the forward (bit for bit): the property a verification forward
    needs to score a token as plain decoding's one-token step does.
    """

    def __init__(
        self, int8_weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        """From int8 weights [out, in] and their float32 scales [out] (:func:`int8_rows`); the weights are
        copied into oneDNN's layout and not kept."""
        super().__init__()
        self.out_features, self.in_features = int8_weight.shape
        self.weight_scale = weight_scale
        self.weight_zero_point = torch.zeros_like(weight_scale, dtype=torch.int64)
        # An opaque oneDNN tensor: [out, in] logically, blocked in memory.
        self.packed_weight = torch.ops.onednn.qlinear_prepack(int8_weight, None)
        self.bias = None if bias is None else bias.detach().float().clone()

    @classmethod
    def of(cls, linear: torch.nn.Linear) -> RowwiseInt8Linear:
        """The int8 form of a float ``linear``."""
        return cls(*int8_rows(linear.weight.detach()), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] float32 -> [..., out] float32
        rows = x.reshape(-1, self.in_features)  # [M, in]
        # The floor keeps 127 / peak finite (an all-zero row quantises to zeros).
        peak = rows.abs().amax(dim=1, keepdim=True).clamp_min(_PEAK_FLOOR)  # [M, 1]
        # Each row onto [-127, 127] by its own scale, then shifted to the kernel's unsigned range.
        q = (rows * (127.0 / peak)).round_().add_(_ZERO_POINT).to(torch.uint8)  # [M, in]
        # The kernel's output is int32 sum * weight scale (activation scale 1): [M, out].
        y = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, _ZERO_POINT, self.packed_weight, self.weight_scale, self.weight_zero_point,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip
        row_scale = peak / 127.0  # [M, 1]
        y = y.mul_(row_scale) if self.bias is None else torch.addcmul(self.bias, y, row_scale)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rowwise (oneDNN)"


# Channels of an embedding row sharing one scale. One scale per row (as the linear layers' weights
# have) lost SmolLM2-135M's copy of a sentence beside int8 linear layers; groups of 32 kept it.
EMBEDDING_GROUP = 32


def int8_groups(weight: torch.Tensor, group: int = EMBEDDING_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (float [rows, cols], ``cols`` a multiple of ``group``) as int8 with one symmetric scale
    per ``group`` channels of a row: (int8 [rows, cols], scale float32 [rows, cols / group]). Rows whose
    width is not a multiple of ``group`` get one scale each."""
    rows, cols = weight.shape
    group = group if cols % group == 0 else cols
    int8, scale = int8_rows(weight.reshape(rows * cols // group, group))
    return int8.reshape(rows, cols), scale.reshape(rows, cols // group)


class Int8Embedding(torch.nn.Module):
    """A token embedding held as int8 with one float32 scale per group of channels
    (:func:`int8_groups`); looks up vectors in ``lookup_dtype`` (float32 unless the model runs in
    another), each the same whatever is looked up beside it."""

    def __init__(
        self,
        int8_weight: torch.Tensor,
        weight_scale: torch.Tensor,
        lookup_dtype: torch.dtype = torch.float32,
        embed_scale: float | None = None,
    ) -> None:
        """From int8 rows [vocab, hidden] and their group scales [vocab, hidden / group] (kept, not
        copied); ``embed_scale`` multiplies every vector looked up, as Gemma's embedding does
        (``scalar_embed_scale``: a float32 scalar, the same product as transformers')."""
        super().__init__()
        self.num_embeddings, self.embedding_dim = int8_weight.shape
        self.group = self.embedding_dim // weight_scale.shape[1]
        self.int8_weight = int8_weight
        self.weight_scale = weight_scale
        self.lookup_dtype = lookup_dtype
        self.embed_scale = None if embed_scale is None else torch.tensor(embed_scale, dtype=lookup_dtype)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """What the embedding holds, by name (what the constructor takes back)."""
        return {"int8_weight": self.int8_weight, "weight_scale": self.weight_scale}

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [...] int64 -> [..., hidden]
        rows = torch.nn.functional.embedding(token_ids, self.int8_weight).float()  # [..., hidden]
        grouped = rows.unflatten(-1, (-1, self.group))  # [..., hidden / group, group]
        looked_up = grouped.mul_(self.weight_scale[token_ids].unsqueeze(-1)).flatten(-2).to(self.lookup_dtype)
        return looked_up if self.embed_scale is None else looked_up * self.embed_scale

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 in groups of {self.group}"


def use_int8_embedding(model: PreTrainedModel) -> None:
    """Replace ``model``'s float token embedding with its :class:`Int8Embedding` (looking up vectors in
    the embedding's dtype), in place, handing the float weight's pages back; nothing to do if it is int8
    already. Call it after the linear layers are rewritten: a tied LM head reads the embedding's weight."""
    embedding = model.get_input_embeddings()
    if type(embedding) is not torch.nn.Embedding and embedding_scale(embedding) is None:
        return  # an embedding of a kind whose lookup is not a plain one times a scale
    weight = embedding.weight.detach()
    scale = embedding_scale(embedding)
    model.set_input_embeddings(
        Int8Embedding(*int8_groups(weight), lookup_dtype=weight.dtype, embed_scale=scale)
    )
    release_pages(weight)


def embedding_scale(embedding: torch.nn.Module) -> float | None:
    """What a model's token embedding multiplies its vectors by (Gemma's ``sqrt(hidden)``), or None."""
    scale = getattr(embedding, "scalar_embed_scale", None)
    return None if scale is None else float(scale)
