"""4-bit weight-only linear layers on the CPU: a sixth of fp32's weight bytes, with PyTorch's own kernel.

The kernel is ATen's int4 packed matmul for the CPU (``_weight_int4pack_mm_for_cpu``, the "tinygemm"
CPU port that torchao's int4 CPU layout also calls), so it needs no dependency beyond torch. Weights are
quantised asymmetrically in groups of :data:`GROUP_SIZE` input channels (a bf16 scale and zero per
group, the layout of GGUF's Q4_0/Q4_K sub-blocks); activations go in as bf16, each product is summed
in fp32 and comes back as bf16. The kernel's x86 fast path (AVX512 or AVX2) takes bf16 activations
only; fp32 ones fall to a scalar loop ~100x slower, which is why the activations are cast here.

A row's result does not depend on the other rows of the product: each output element is one fp32
fused multiply-add chain over the input channels in a fixed order, the same in the kernel's one-row and
four-row tiles (checked bit for bit by tests/test_int4.py). With row-by-row attention
(:mod:`marspec.backends.row_attention`) a verification forward then scores each token exactly as plain
decoding's one-token step does, so strict verification of a 4-bit target equals plain decoding of that
same 4-bit target, as for the row-wise int8 target.

Cost (docs/results.md, "4-bit weights"): the kernel dequantises a weight tile in registers for every
block of four rows, so while a one-token step costs about an int8 one (on an AMX Xeon), a 13-token
verification costs ~5 steps, as much as prepacked fp32's (int8's costs about one step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from marspec.backends.memory import own_remaining_tensors, release_pages, rewrite_linears, trim_heap
from marspec.errors import MarspecError

# Input channels sharing one scale and zero. 32 is GGUF Q4_0's block and Q4_K's sub-block; 64-256 cost
# the same per step here (the kernel takes 32, 64, 128 or 256) and quantise coarser.
GROUP_SIZE = 32
# The kernel packs output channels in tiles of 16: layers with another count are padded with zero rows.
_N_MULTIPLE = 16
_QMAX = 15  # unsigned 4-bit codes 0..15; the kernel subtracts 8
_TINY = torch.finfo(torch.float32).tiny


def int4_available() -> bool:
    """Whether this torch build has ATen's int4 CPU kernels."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


INT4_UNAVAILABLE = (
    "4-bit weights need ATen's int4 CPU kernels (_weight_int4pack_mm_for_cpu, torch >= 2.5), which this "
    "torch build lacks: use 'int8' or 'none'"
)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pack_int4(weight: torch.Tensor, rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (float [out, in], ``in`` a multiple of :data:`GROUP_SIZE`, ``out`` of 16) as the
    kernel's packed 4-bit codes and its scales and zeros: (uint8 [out, in / 2], bf16 [in / GROUP_SIZE,
    out, 2]).

    A group's codes span its minimum to its maximum; the value of code ``q`` is ``(q - 8) * scale +
    zero``. The codes are chosen against the bf16-rounded scale and zero the kernel will use. A chunk of
    rows at a time (a multiple of the kernel's 64-row blocks, so the chunks pack as the whole would),
    each chunk's pages handed back once converted: the 1.5B's LM head is 0.9 GB of fp32, and its codes
    as int32 would be as much again.
    """
    out_features, in_features = weight.shape
    groups = in_features // GROUP_SIZE
    packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
    scale_zero = torch.empty(groups, out_features, 2, dtype=torch.bfloat16)
    for start in range(0, out_features, rows_per_chunk):
        chunk = weight[start : start + rows_per_chunk]
        grouped = chunk.float().reshape(-1, groups, GROUP_SIZE)  # [rows, groups, G]
        low, high = grouped.amin(dim=2), grouped.amax(dim=2)  # [rows, groups]
        scale = ((high - low) / _QMAX).clamp_min(_TINY).bfloat16()
        zero = (low + 8 * scale.float()).bfloat16()
        q = (grouped - zero.float()[..., None]).div_(scale.float()[..., None])
        q = q.add_(8).round_().clamp_(0, _QMAX)
        codes = q.reshape(chunk.shape).to(torch.int32)
        packed[start : start + rows_per_chunk] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        scale_zero[:, start : start + rows_per_chunk, 0] = scale.t()
        scale_zero[:, start : start + rows_per_chunk, 1] = zero.t()
        release_pages(chunk)
    return packed, scale_zero


class Int4Linear(torch.nn.Module):
    """``nn.Linear`` with 4-bit weights (a scale and zero per :data:`GROUP_SIZE` input channels) run by
    ATen's int4 CPU kernel on bf16 activations (inference only). Returns the input's dtype.

    A row's output is the same bits whatever else is in the forward (see the module's docstring).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """From a linear layer's float ``weight`` [out, in] and ``bias`` [out] (copied, not kept)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach()
        padded_in = _round_up(self.in_features, GROUP_SIZE)
        padded_out = _round_up(self.out_features, _N_MULTIPLE)
        if (padded_out, padded_in) != tuple(weight.shape):
            # Zero rows give outputs that are cut off; zero columns meet zero inputs: nothing changes.
            weight = F.pad(weight, (0, padded_in - self.in_features, 0, padded_out - self.out_features))
        self.packed_weight, self.scale_and_zeros = _pack_int4(weight)  # uint8 [N, K/2], bf16 [K/G, N, 2]
        self.bias = None if bias is None else bias.detach().clone()

    @classmethod
    def of(cls, linear: torch.nn.Linear) -> Int4Linear:
        """The 4-bit form of ``linear``."""
        return cls(linear.weight, linear.bias)

    @classmethod
    def packed(
        cls,
        in_features: int,
        out_features: int,
        packed_weight: torch.Tensor,
        scale_and_zeros: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> Int4Linear:
        """A layer from the :attr:`tensors` of one quantised before (kept, not copied)."""
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.in_features, layer.out_features = in_features, out_features
        layer.packed_weight, layer.scale_and_zeros, layer.bias = packed_weight, scale_and_zeros, bias
        return layer

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """What the layer holds, by name (what :meth:`packed` takes back)."""
        held = {"packed_weight": self.packed_weight, "scale_and_zeros": self.scale_and_zeros}
        return held if self.bias is None else held | {"bias": self.bias}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out], x's dtype
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, in]
        padded_in = self.packed_weight.shape[1] * 2
        if padded_in != self.in_features:
            rows = F.pad(rows, (0, padded_in - self.in_features))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed_weight, GROUP_SIZE, self.scale_and_zeros
        )  # bf16 [M, padded out]
        y = y[:, : self.out_features].to(x.dtype)
        if self.bias is not None:
            y = y.add_(self.bias.to(x.dtype))
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 groups of {GROUP_SIZE} (ATen)"
        )


def quantize_int4(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every ``nn.Linear`` of an fp32 or bf16 model with an :class:`Int4Linear`, in place.

    The embeddings and norms keep the model's dtype. An LM head tied to the input embeddings gets a
    4-bit copy and the embedding keeps its own. Memory stays about one copy of the model while
    quantising (:mod:`marspec.backends.memory`). For a target, also switch its attention to the
    row-by-row form (:func:`marspec.backends.row_attention.use_row_attention`).
    """
    if not int4_available():
        raise MarspecError(INT4_UNAVAILABLE)
    with torch.no_grad():
        rewritten = rewrite_linears(
            model,
            Int4Linear.of,
            "cannot quantise {name} with {dtype} weights to 4 bits: load the model in fp32 or bf16",
            trim=True,
        )
    # Else loaded in 4 bits already: built in memory from the GGUF (models.gguf_int4), or read back as
    # views of its stored file (models.int4_cache), every page of which the model uses.
    if rewritten:
        own_remaining_tensors(model)
    trim_heap()
    return model
