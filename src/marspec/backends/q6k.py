"""A GGUF's Q6_K weights, multiplied by int8 activations (marspec's CPU kernels).

A Q6_K super-block holds 256 weights of one output row in 210 bytes: 6-bit codes ``q`` (their low 4
bits in ``ql[128]``, their top 2 in ``qh[64]``), sixteen signed int8 scales ``sc`` (one per 16
weights) and an fp16 ``d``; a weight is ``d * sc * (q - 32)`` (ggml). :class:`Q6KLinear` keeps exactly those
bytes (6.5625 bits a weight, no second rounding), repacked once so that the kernel (``kernels/q6k.cpp``, built
with the Q4_K kernel into one library per CPU path: :mod:`marspec.backends.kernels`) reads each weight once
per call whatever the number of rows, in one sequential stream per 32 output columns. Its input is quantised
to int8 per token row as :class:`~.q4k.Q4KLinear`'s is, and each row's sums run in the same order whatever
else is in the call: a row's output is the same bits in a 13-token verification as in a one-token step, and on
every CPU path.

The packed weights are one plain uint8 tensor whose layout does not depend on the CPU that made it
(:attr:`Q6KLinear.tensors`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from marspec.backends import kernels
from marspec.backends.q4k import (
    HALF,
    SUPER_BLOCK,
    TILE,
    packed_tiles,
    quantised_rows_product,
)

GGML_Q6_K = 14  # ggml's type number
Q6K_BLOCK_BYTES = 210  # a super-block in the GGUF: ql[128], qh[64], scales[16] (int8), d (fp16)
_SUB_BLOCK = 16  # weights per scale
_SUBS = SUPER_BLOCK // _SUB_BLOCK
_RECORD_BYTES = TILE * Q6K_BLOCK_BYTES  # a tile's super-block (layout: kernels/q6k.cpp)
_TOP_SHIFTS = np.array([0, 2, 4, 6], np.uint8)[:, None]  # step i's top 2 bits to bits 2i, 2i + 1 of a byte
_ROWS_PER_CHUNK = 4096  # rows dequantised at a time: bounds the temporaries' memory


class _Q6KFields(NamedTuple):
    """The decoded fields of Q6_K blocks for N rows of K weights."""

    d: np.ndarray  # float32 [N, K / 256]
    sc: np.ndarray  # int8 [N, K / 256, 16]
    q: np.ndarray  # uint8 [N, K], 0..63


def _q6k_fields(raw: np.ndarray) -> _Q6KFields:
    """Decode raw Q6_K bytes (uint8 [N, K / 256 * 210], rows as in the GGUF file) into their fields."""
    rows, width = raw.shape
    if width % Q6K_BLOCK_BYTES:
        raise ValueError(f"a Q6_K row is a multiple of {Q6K_BLOCK_BYTES} bytes, not {width}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(
        rows, width // Q6K_BLOCK_BYTES, Q6K_BLOCK_BYTES
    )
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    sc = blocks[..., 192:208].view(np.int8)
    d = blocks[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    # Each 128-weight half of a super-block: weight i < 64 has the low nibble of ql byte i, weight 64 + i
    # its high nibble; weight 32t + i (t = 0..3) has bits 2t, 2t + 1 of qh byte i.
    low = ql.reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    high = qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    q = (low & 0x0F).reshape(rows, -1) | ((high & 0x03).reshape(rows, -1) << 4)
    return _Q6KFields(d, sc, q)


def dequantize_q6k(raw: np.ndarray, rows_per_chunk: int = _ROWS_PER_CHUNK) -> torch.Tensor:
    """The float32 weights [N, K] of raw Q6_K bytes (the values ggml and gguf-py give: ``(d * sc) * (q -
    32)`` in float32), a chunk of rows at a time: whole, the 1.5B Qwen's LM head would hold ~3 GB of
    temporaries beside its 0.93 GB."""
    rows, width = raw.shape
    out = np.empty((rows, width // Q6K_BLOCK_BYTES * SUPER_BLOCK), dtype=np.float32)
    for start in range(0, rows, rows_per_chunk):
        d, sc, q = _q6k_fields(raw[start : start + rows_per_chunk])
        scale = (d[..., None] * sc.astype(np.float32))[..., None]  # [rows, S, 16, 1]
        codes = (q.astype(np.int8) - np.int8(32)).reshape(*sc.shape, _SUB_BLOCK).astype(np.float32)
        out[start : start + rows_per_chunk] = (scale * codes).reshape(q.shape)
    return torch.from_numpy(out)


def _pack(raw: np.ndarray) -> torch.Tensor:
    """The kernel's blocks for raw Q6_K bytes [N, K / 256 * 210]: uint8 [ceil(N / 32), K / 256, 6720],
    the last tile's missing columns zero (layout: kernels/q6k.cpp)."""
    return packed_tiles(raw, GGML_Q6_K, Q6K_BLOCK_BYTES, _RECORD_BYTES, _pack_tiles)


def _pack_tiles(chunk: np.ndarray) -> np.ndarray:
    """Whole tiles of raw Q6_K rows [32 * T, K / 256 * 210] as the kernel's records [T, K / 256, 6720]."""
    f = _q6k_fields(chunk)
    count, supers = chunk.shape[0] // TILE, chunk.shape[1] // Q6K_BLOCK_BYTES
    # Codes [tile, half, column, super, sub, 16 weights].
    q = f.q.reshape(count, 2, HALF, supers, _SUBS, _SUB_BLOCK)
    # Nibbles [.., sub, vector p, 4 apart, 4]: a byte holds the low 4 bits of weights 8p + b, 8p + 4 + b.
    low = (q & 0x0F).reshape(count, 2, HALF, supers, _SUBS, 2, 2, 4)
    nibbles = low[..., 0, :] | (low[..., 1, :] << 4)  # [.., sub, p, 4]
    # Top bits [.., sub, step i, 4]: a byte holds the top 2 bits of weights 4i + b in bits 2i, 2i + 1.
    top = (q >> 4).reshape(count, 2, HALF, supers, _SUBS, 4, 4) << _TOP_SHIFTS
    top = np.bitwise_or.reduce(top, axis=-2)  # [.., sub, 4]
    # Per sub-block: vector p 0, vector p 1, the top bits; each 64 bytes, byte 4 * column + b.
    vectors = np.concatenate([nibbles.reshape(count, 2, HALF, supers, _SUBS, 8), top], axis=-1)
    codes = vectors.reshape(count, 2, HALF, supers, _SUBS, 3, 4)
    codes = codes.transpose(0, 3, 1, 4, 5, 2, 6).reshape(count, supers, -1)
    sc = f.sc.view(np.uint8).reshape(count, 2, HALF, supers, _SUBS)
    sc = sc.transpose(0, 3, 1, 4, 2).reshape(count, supers, -1)
    d = f.d.astype("<f2").reshape(count, 2, HALF, supers)
    d = np.ascontiguousarray(d.transpose(0, 3, 1, 2)).reshape(count, supers, -1).view(np.uint8)
    return np.concatenate([codes, sc, d], axis=-1)


class Q6KLinear(torch.nn.Module):
    """``nn.Linear`` on Q6_K weights with int8 activations, one scale per token row (inference only;
    needs :func:`marspec.backends.kernels.kernels_available`). A row's output does not depend on the other
    rows (bit for bit)."""

    def __init__(
        self, blocks: torch.Tensor, out_features: int | torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        """From the packed weights (:attr:`tensors`; kept, not copied): ``blocks`` uint8
        [ceil(N / 32), K / 256, 6720], ``out_features`` N (an int or an int64 tensor of one element) and
        an optional float bias [N]. The kernel is found here, once, rather than in every forward."""
        super().__init__()
        self._linear = kernels.ops().q6k_linear
        self.blocks = blocks.contiguous()
        self.out_features = int(out_features)
        self.in_features = blocks.shape[1] * SUPER_BLOCK
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def from_gguf_blocks(cls, raw: np.ndarray, bias: torch.Tensor | None = None) -> Q6KLinear:
        """From raw Q6_K bytes (uint8 [N, K / 256 * 210], rows the output channels, as in the GGUF)."""
        return cls(_pack(raw), raw.shape[0], bias)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """What the layer holds, by name: the constructor's arguments (``Q6KLinear(**layer.tensors)``)."""
        held = {"blocks": self.blocks, "out_features": torch.tensor([self.out_features], dtype=torch.int64)}
        return held if self.bias is None else {**held, "bias": self.bias}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] float32 -> [..., out] float32
        rows = x.reshape(-1, self.in_features).float()
        y = self._linear(rows, self.blocks, self.out_features, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q6_K x int8 rows"


def q6k_reference(x: torch.Tensor, raw: np.ndarray, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What :class:`Q6KLinear` computes, in float64 with torch: each row of ``x`` [..., K] quantised to
    int8 as the kernel does, times the dequantised weights, times the row's scale; [..., N] float64."""
    return quantised_rows_product(x, dequantize_q6k(raw), bias)
