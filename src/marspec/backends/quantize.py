"""Int8 linear layers: a cheaper draft, and a smaller, faster target that keeps strict == plain.

A draft only proposes; the target's verification decides every emitted token. So the draft may be
approximated freely: a wrong proposal costs acceptance, never correctness (and in sampling mode the
draft's probabilities are those of the quantised model, so losslessness holds for the model we run).
:func:`quantize_int8` uses torch's dynamic int8 layers (fbgemm), the fastest here for the draft's small
products, which scale each forward's activations as a whole.

That whole-forward scale makes a row's result depend on the other rows of its forward, so a target
quantised that way scores a token differently in a 13-token verification than in plain decoding's
one-token step, and strict verification no longer equals plain decoding (it broke on the 23rd token of
a small model). :func:`quantize_target_int8` gives each token row its own activation scale instead
(:class:`RowwiseInt8Linear`): the integer product is exact, so every row's output is the same bits
whatever else is in the forward. Its kernel is oneDNN's int8 product (VNNI or AMX on x86). Attention,
the one other place rows meet, is then computed row by row (:mod:`marspec.backends.row_attention`), so
a chain forward scores each token exactly as a one-token forward would, and strict verification of the
int8 target equals plain decoding of the same int8 target.

4-bit weights (``"int4"``, for the target or the draft) are :mod:`marspec.backends.int4`'s; this module
holds the choice between the precisions (:func:`check_target_quant`, :func:`quantize_target`,
:func:`quantize_draft`).
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantLinear
from transformers import PreTrainedModel

from marspec.backends.int4 import INT4_UNAVAILABLE, int4_available, quantize_int4
from marspec.backends.memory import own_remaining_tensors, release_pages, trim_heap
from marspec.backends.row_attention import check_row_attention, use_row_attention
from marspec.errors import MarspecError

DRAFT_QUANTS = ("none", "int8", "int4")
TARGET_QUANTS = ("none", "int8", "int4")


def quantize_int8(model: PreTrainedModel) -> PreTrainedModel:
    """Replace every ``nn.Linear`` with an int8 dynamically quantised one (per-output-channel scales).

    On this CPU the 0.5B Qwen draft goes from ~126 to ~46 ms per token; its greedy choice agrees with the
    1.5B target on 91% of positions against 94.5% in fp32 (per-tensor scales: 88%). The activations are
    quantised at run time with one scale per forward (see the module's docstring for what that costs).
    """
    if next(model.parameters()).dtype != torch.float32:
        raise MarspecError("int8 draft quantisation needs the draft loaded in fp32 (use dtype='fp32')")
    with warnings.catch_warnings():
        # torch.ao's eager quantisation is deprecated in favour of torchao, which does not ship for this
        # torch build; the kernels (fbgemm) are the same ones and still present.
        warnings.simplefilter("ignore")
        # Layer by layer (what quantize_dynamic does, one swap at a time), giving back each fp32 weight's
        # pages as soon as its int8 copy exists (:mod:`marspec.backends.memory`).
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    child.qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
                    setattr(parent, name, DynamicQuantLinear.from_float(child))
                    release_pages(child.weight)
    own_remaining_tensors(model)
    return model


# CPU features with an int8 dot product that sums into 32 bits. Without one, x86 int8 kernels add pairs
# of uint8 x int8 products in 16 bits, which saturates for activations near 255 against weights near
# 127: the products would be quietly wrong (the same way in every row, so strict would still equal plain).
_INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


INT8_UNAVAILABLE = (
    "target_quant='int8' needs oneDNN's int8 kernels and a CPU with an int8 dot product (x86 VNNI or "
    "AMX), which this torch build or CPU lacks: use target_quant='none'"
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


def _int8_rows(weight: torch.Tensor, rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (float32 [out, in]) as int8 with one symmetric scale per row: (int8 [out, in], scale
    float32 [out]). A chunk of rows at a time, each chunk's pages handed back once it is converted: the
    1.5B target's LM head alone is 0.9 GB of fp32."""
    int8 = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], rows_per_chunk):
        chunk = weight[start : start + rows_per_chunk]  # [rows, in]
        peak = torch.maximum(chunk.amax(dim=1), chunk.amin(dim=1).neg())  # [rows]
        chunk_scale = (peak / 127.0).clamp_min(_TINY)
        int8[start : start + rows_per_chunk] = torch.div(chunk, chunk_scale[:, None]).round_()  # |q| <= 127
        scale[start : start + rows_per_chunk] = chunk_scale
        release_pages(chunk)
    return int8, scale


class RowwiseInt8Linear(torch.nn.Module):
    """``nn.Linear`` with int8 weights (one scale per output channel) and int8 activations (one scale per
    token row, chosen at run time), run by oneDNN (inference only).

    Each row is quantised on its own and the int8 product is summed exactly in int32, so a row's output
    does not depend on the other rows of the forward (bit for bit): the property a verification forward
    needs to score a token as plain decoding's one-token step does.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        int8_weight, scale = _int8_rows(linear.weight.detach())
        self.weight_scale = scale
        self.weight_zero_point = torch.zeros_like(scale, dtype=torch.int64)
        # An opaque oneDNN tensor: [out, in] logically, blocked in memory.
        self.packed_weight = torch.ops.onednn.qlinear_prepack(int8_weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()

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


def quantize_target_int8(model: PreTrainedModel) -> PreTrainedModel:
    """Replace every ``nn.Linear`` of an fp32 model with a :class:`RowwiseInt8Linear`, in place.

    About a quarter of the linear weights' bytes; the embeddings and norms stay fp32. An LM head tied to
    the input embeddings gets an int8 copy and the embedding keeps its own. The model's attention is
    switched to the row-by-row form (:func:`use_row_attention`).
    """
    if next(model.parameters()).dtype != torch.float32:
        raise MarspecError("int8 target quantisation needs the target loaded in fp32 (use dtype='fp32')")
    check_row_attention(model)
    if not rowwise_int8_available():
        raise MarspecError(INT8_UNAVAILABLE)
    use_row_attention(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, RowwiseInt8Linear(child))
                release_pages(child.weight)
                trim_heap()
    own_remaining_tensors(model)
    trim_heap()
    return model


def check_target_quant(target_quant: str, dtype: torch.dtype) -> None:
    """Raise a one-line error unless a target loaded in ``dtype`` can be quantised to ``target_quant``
    here (before any weight is loaded). Where it runs (the CPU) and what was passed are the caller's."""
    if target_quant not in TARGET_QUANTS:
        raise MarspecError(f"unknown target_quant {target_quant!r}: choose one of {', '.join(TARGET_QUANTS)}")
    if target_quant == "int8":
        if dtype != torch.float32:
            raise MarspecError("target_quant='int8' quantises an fp32 target: use dtype='fp32'")
        if not rowwise_int8_available():
            raise MarspecError(INT8_UNAVAILABLE)
    if target_quant == "int4":
        if dtype not in (torch.float32, torch.bfloat16):
            raise MarspecError("target_quant='int4' quantises an fp32 or bf16 target: use dtype='fp32'")
        if not int4_available():
            raise MarspecError(INT4_UNAVAILABLE)


def check_draft_quant(draft_quant: str) -> None:
    """Raise a one-line error unless ``draft_quant`` names a draft precision this build can run."""
    if draft_quant not in DRAFT_QUANTS:
        raise MarspecError(f"unknown draft_quant {draft_quant!r}: choose one of {', '.join(DRAFT_QUANTS)}")
    if draft_quant == "int4" and not int4_available():
        raise MarspecError(INT4_UNAVAILABLE)


def quantize_target(model: PreTrainedModel, target_quant: str) -> PreTrainedModel:
    """Quantise a target's linear layers to ``target_quant`` ("int8" or "int4"), in place, with
    attention one query row at a time: either way a verification forward scores each token as plain
    decoding's one-token step does, bit for bit."""
    if target_quant == "int8":
        return quantize_target_int8(model)
    check_row_attention(model)
    use_row_attention(model)
    return quantize_int4(model)


def quantize_draft(model: PreTrainedModel, draft_quant: str) -> PreTrainedModel:
    """Quantise a draft's linear layers to ``draft_quant`` ("int8" or "int4"), in place. A draft's
    rows may depend on each other (it only proposes), so its attention is left as it is."""
    return quantize_int8(model) if draft_quant == "int8" else quantize_int4(model)
