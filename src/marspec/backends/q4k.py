"""Linear layers on a GGUF's Q4_K weights, multiplied by int8 activations (marspec's CPU kernels).

A Q4_K super-block holds 256 weights of one output row: fp16 ``d`` and ``dmin``, eight 32-weight
sub-blocks with 6-bit scales ``sc`` and mins ``m`` (12 bytes), and 4-bit codes ``q``; a weight is
``d * sc * q - dmin * m`` (ggml). :class:`Q4KLinear` keeps the codes at 4 bits and the scales beside
them (4.75 bits a weight: float32 ``d``, ``dmin`` and uint8 ``sc``, ``m``), repacked once so that the
kernel (``kernels/q4k.cpp``, on the CPU's path: :mod:`marspec.backends.kernels`) reads each weight once
per call whatever the number of rows, in one sequential stream per 32 output columns. Its input is
quantised to int8 per token row, as :class:`~marspec.backends.int8.RowwiseInt8Linear`'s is, and each
row's sums run in the same order whatever else is in the call: a row's output is the same bits in a
13-token verification as in a one-token step, and on every CPU path (AVX2, AVX-512, AMX, NEON): the same
bits, at the path's speed.

The packed weights are one plain uint8 tensor (its float32 fields little-endian) whose layout does not
depend on the CPU that made it (:attr:`Q4KLinear.tensors`); weights that come in float are first
quantised to Q4_K blocks by :func:`q4k_blocks`, so both sources share one path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from marspec.backends import kernels
from marspec.backends.int8 import _PEAK_FLOOR
from marspec.errors import MarspecError

SUPER_BLOCK = 256  # weights per super-block
SUB_BLOCK = 32  # weights per sub-block (one scale and min)
_SUBS = SUPER_BLOCK // SUB_BLOCK
GGML_Q4_K = 12  # ggml's type number
BLOCK_BYTES = 144  # a super-block in the GGUF: d, dmin (fp16), 12 bytes of scales, 128 of codes
HALF = 16  # output columns in one zmm's lanes
TILE = 2 * HALF  # output columns the kernel computes together
_SUB_CODE_BYTES = TILE * SUB_BLOCK // 2  # a record's codes of one sub-block (both halves)
_RECORD_TAIL = TILE * (2 * _SUBS + 2 * 4)  # a record's scales, mins, d and dmin (both halves)
RECORD_BYTES = _SUBS * _SUB_CODE_BYTES + _RECORD_TAIL  # a tile's super-block: 4.75 bits a weight
_ROWS_PER_CHUNK = 4096  # rows repacked at a time (a multiple of TILE): bounds the repacking's memory


class Q4KFields(NamedTuple):
    """The decoded fields of Q4_K blocks for N rows of K weights."""

    d: np.ndarray  # float32 [N, K / 256]
    dmin: np.ndarray  # float32 [N, K / 256]
    sc: np.ndarray  # uint8 [N, K / 256, 8], 0..63
    m: np.ndarray  # uint8 [N, K / 256, 8], 0..63
    q: np.ndarray  # uint8 [N, K], 0..15


def q4k_fields(raw: np.ndarray) -> Q4KFields:
    """Decode raw Q4_K bytes (uint8 [N, K / 256 * 144], rows as in the GGUF file) into their fields."""
    rows, width = raw.shape
    if width % BLOCK_BYTES:
        raise ValueError(f"a Q4_K row is a multiple of {BLOCK_BYTES} bytes, not {width}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, width // BLOCK_BYTES, BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    low, high, mixed = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    # Sub-blocks 0-3 keep 6 bits in bytes 4-11; 4-7 keep their low 4 bits in 12-15, their top 2 in the
    # top bits of 4-11.
    sc = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 6) << 4)], axis=-1)
    m = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 6) << 4)], axis=-1)
    codes = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)  # 4 chunks of 64 weights: low nibbles first
    q = ((codes >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F).reshape(rows, -1)
    return Q4KFields(d, dmin, sc, m, q)


def dequantize_q4k(raw: np.ndarray, rows_per_chunk: int = _ROWS_PER_CHUNK) -> torch.Tensor:
    """The float32 weights [N, K] of raw Q4_K bytes (the values ggml and gguf-py give), a chunk of rows at
    a time: whole, the 1.5B Qwen's embedding would hold ~3 GB of temporaries beside its 0.93 GB."""
    rows, width = raw.shape
    out = np.empty((rows, width // BLOCK_BYTES * SUPER_BLOCK), dtype=np.float32)
    for start in range(0, rows, rows_per_chunk):
        d, dmin, sc, m, q = q4k_fields(raw[start : start + rows_per_chunk])
        scale = (d[..., None] * sc.astype(np.float32))[..., None]  # [rows, S, 8, 1]
        offset = (dmin[..., None] * m.astype(np.float32))[..., None]
        codes = q.reshape(*sc.shape, SUB_BLOCK).astype(np.float32)
        out[start : start + rows_per_chunk] = (scale * codes - offset).reshape(q.shape)
    return torch.from_numpy(out)


def q4k_blocks(weight: torch.Tensor) -> np.ndarray:
    """Raw Q4_K bytes (uint8 [N, K / 256 * 144]) for float weights [N, K] (K a multiple of 256): each
    sub-block's range split into 15 steps from its minimum (or 0), the scales quantised to 6 bits of
    the super-block's largest. A plain quantiser, not llama.cpp's search for the best scales."""
    rows, cols = weight.shape
    if cols % SUPER_BLOCK:
        raise ValueError(f"Q4_K needs rows of a multiple of {SUPER_BLOCK} weights, not {cols}")
    w = weight.detach().float().cpu().numpy().reshape(rows, cols // SUPER_BLOCK, _SUBS, SUB_BLOCK)
    low = np.minimum(w.min(axis=-1), 0.0)  # [N, S, 8]
    step = (w.max(axis=-1) - low) / 15.0
    d = (step.max(axis=-1) / 63.0).astype(np.float16)  # [N, S]
    dmin = (-low.min(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[..., None] > 0, np.rint(step / d32[..., None]), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin32[..., None] > 0, np.rint(-low / dmin32[..., None]), 0).clip(0, 63).astype(np.uint8)
        scale = d32[..., None] * sc.astype(np.float32)  # the dequantiser's values
        offset = dmin32[..., None] * m.astype(np.float32)
        q = np.where(scale[..., None] > 0, np.rint((w + offset[..., None]) / scale[..., None]), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(rows, -1, 4, 2, SUB_BLOCK)
    blocks = np.empty((rows, cols // SUPER_BLOCK, BLOCK_BYTES), dtype=np.uint8)
    blocks[..., 0:2] = d[..., None].view(np.uint8)
    blocks[..., 2:4] = dmin[..., None].view(np.uint8)
    blocks[..., 4:8] = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    blocks[..., 8:12] = (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6)
    blocks[..., 12:16] = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    blocks[..., 16:] = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(rows, -1, 128)
    return blocks.reshape(rows, -1)


def packed_tiles(
    raw: np.ndarray, qtype: int, block_bytes: int, record_bytes: int, pack: Callable[[np.ndarray], np.ndarray]
) -> torch.Tensor:
    """A kernel's blocks for raw GGUF rows of ggml type ``qtype`` [N, K / 256 * block_bytes]: uint8
    [ceil(N / 32), K / 256, record_bytes]. Packed by the kernels where they run here without a compile
    (``gguf_pack_tiles``: the same bytes, ~5x faster), else by numpy a chunk of rows at a time (bounding
    the repacking's memory), each chunk padded with zero rows to whole tiles of 32 and given to ``pack``
    ([32 * T, ...] -> [T, K / 256, record_bytes])."""
    if kernels.library_ready():
        blocks = np.ascontiguousarray(raw, dtype=np.uint8)
        return kernels.ops().gguf_pack_tiles(kernels.read_only_tensor(blocks), qtype)
    rows = raw.shape[0]
    supers = raw.shape[1] // block_bytes
    blocks = np.empty((-(-rows // TILE), supers, record_bytes), dtype=np.uint8)
    for start in range(0, rows, _ROWS_PER_CHUNK):
        chunk = raw[start : start + _ROWS_PER_CHUNK]
        padded = -(-chunk.shape[0] // TILE) * TILE
        if padded != chunk.shape[0]:
            chunk = np.concatenate([chunk, np.zeros((padded - chunk.shape[0], chunk.shape[1]), np.uint8)])
        blocks[start // TILE : (start + padded) // TILE] = pack(chunk)
    return torch.from_numpy(blocks)


def tile_bytes(width: int) -> int:
    """The bytes of one tile of 32 output columns for a layer ``width`` wide (a multiple of 32): a record
    per super-block, the last holding the codes of only the sub-blocks that hold weights."""
    whole, used = divmod(width // SUB_BLOCK, _SUBS)
    return whole * RECORD_BYTES + (used * _SUB_CODE_BYTES + _RECORD_TAIL if used else 0)


def kernel_width(blocks: torch.Tensor) -> int:
    """The width (a multiple of 32) whose tiles are ``blocks``' rows (:func:`tile_bytes` inverted)."""
    whole, rest = divmod(blocks.shape[-1], RECORD_BYTES)
    used, odd = divmod(rest - _RECORD_TAIL, _SUB_CODE_BYTES) if rest else (0, 0)
    if blocks.dim() != 2 or odd or not 0 <= used < _SUBS:
        raise MarspecError(
            f"Q4_K blocks of shape {tuple(blocks.shape)} are not whole tiles; write them again"
        )
    return whole * SUPER_BLOCK + used * SUB_BLOCK


def _pack(raw: np.ndarray, width: int | None = None) -> torch.Tensor:
    """The kernel's blocks for raw Q4_K bytes [N, K / 256 * 144] of a layer ``width`` wide (K when None;
    else a multiple of 32 the rows' padding past which is dropped): uint8 [ceil(N / 32), tile_bytes],
    the last tile's missing columns zero (layout: kernels/q4k.cpp)."""
    tiles = packed_tiles(raw, GGML_Q4_K, BLOCK_BYTES, RECORD_BYTES, _pack_tiles)  # [T, S, record]
    width = tiles.shape[1] * SUPER_BLOCK if width is None else width
    used = width % SUPER_BLOCK // SUB_BLOCK
    if not used:
        return tiles.reshape(tiles.shape[0], -1)
    # The last record keeps the codes of its first `used` sub-blocks of each half, then its tail.
    half = _SUBS * _SUB_CODE_BYTES // 2
    kept = used * _SUB_CODE_BYTES // 2
    last = tiles[:, -1]
    parts = (tiles[:, :-1].reshape(tiles.shape[0], -1), last[:, :kept], last[:, half : half + kept])
    return torch.cat([*parts, last[:, 2 * half :]], dim=1)


def _pack_tiles(chunk: np.ndarray) -> np.ndarray:
    """Whole tiles of raw Q4_K rows [32 * T, K / 256 * 144] as the kernel's records [T, K / 256, 4864]."""
    return pack_fields(q4k_fields(chunk))


def pack_fields(f: Q4KFields) -> np.ndarray:
    """Q4_K fields of whole tiles of rows (32 * T of them, K weights each, ``d`` and ``dmin`` taken as
    float32) as the kernel's records [T, K / 256, 4864]."""
    count, supers = f.q.shape[0] // TILE, f.d.shape[1]
    # Codes [tile, half, column, super, sub, chunk of 8, 4 apart, 4]: a byte holds weights 4 apart.
    q = f.q.reshape(count, 2, HALF, supers, _SUBS, 4, 2, 4)
    codes = q[..., 0, :] | (q[..., 1, :] << 4)  # [tile, half, column, super, sub, chunk, 4]
    codes = codes.transpose(0, 3, 1, 4, 5, 2, 6).reshape(count, supers, -1)
    scales = np.concatenate([f.sc, f.m], axis=-1).reshape(count, 2, HALF, supers, 2 * _SUBS)
    scales = scales.transpose(0, 3, 1, 4, 2).reshape(count, supers, -1)
    d = np.stack([f.d, f.dmin], axis=-1).astype("<f4").reshape(count, 2, HALF, supers, 2)
    d = d.transpose(0, 3, 1, 4, 2).reshape(count, supers, -1).view(np.uint8)
    return np.concatenate([codes, scales, d], axis=-1)


class Q4KLinear(torch.nn.Module):
    """``nn.Linear`` on Q4_K weights with int8 activations, one scale per token row (inference only;
    needs :func:`marspec.backends.kernels.kernels_available`). A row's output does not depend on the other
    rows (bit for bit).
    """

    def __init__(
        self,
        blocks: torch.Tensor,
        out_features: int | torch.Tensor,
        bias: torch.Tensor | None = None,
        in_features: int | torch.Tensor | None = None,
    ) -> None:
        """From the packed weights (:attr:`tensors`; kept, not copied): ``blocks`` uint8
        [ceil(N / 32), tile bytes] (:func:`tile_bytes` of the layer's width rounded up to 32),
        ``out_features`` N (an int or an int64 tensor of one element), an optional float bias [N], and
        ``in_features`` where the layer's input is narrower than that width (zero weights pad each row,
        and zeros the input). The kernel is found here, once, rather than in every forward."""
        super().__init__()
        self._linear = kernels.ops().q4k_linear
        self.blocks = blocks.contiguous()
        self.out_features = int(out_features)
        width = kernel_width(self.blocks)
        self.in_features = width if in_features is None else int(in_features)
        # The kernel reads rows of a multiple of a sub-block (32); a narrower remainder is padded here.
        self._pad = width - self.in_features
        if not 0 <= self._pad < SUB_BLOCK:
            raise MarspecError(f"Q4_K blocks {width} wide do not fit a layer {self.in_features} wide")
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @property
    def pad(self) -> int:
        """The zeros each input row is widened by for the kernel (its width a multiple of 32)."""
        return self._pad

    @classmethod
    def from_gguf_blocks(cls, raw: np.ndarray, bias: torch.Tensor | None = None) -> Q4KLinear:
        """From raw Q4_K bytes (uint8 [N, K / 256 * 144], rows the output channels, as in the GGUF)."""
        return cls(_pack(raw), raw.shape[0], bias)

    @classmethod
    def of(cls, linear: torch.nn.Linear) -> Q4KLinear:
        """The Q4_K form of a float ``linear`` (quantised by :func:`q4k_blocks`, a chunk of rows at a
        time, each row padded with zeros to a multiple of 256 weights, a padding the packed form drops)."""
        return cls.from_float(linear.weight.detach(), linear.bias)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, rows_per_chunk: int = _ROWS_PER_CHUNK
    ) -> Q4KLinear:
        """From float weights [N, K] of any width K (see :meth:`of`)."""
        in_features = weight.shape[1]
        pad = -in_features % SUPER_BLOCK
        chunks = []
        for start in range(0, weight.shape[0], rows_per_chunk):  # bounds the quantiser's float temporaries
            chunk = weight[start : start + rows_per_chunk].float()
            chunks.append(q4k_blocks(torch.nn.functional.pad(chunk, (0, pad)) if pad else chunk))
        width = -(-in_features // SUB_BLOCK) * SUB_BLOCK
        layer_width = in_features if width != in_features else None
        return cls(_pack(np.concatenate(chunks), width), weight.shape[0], bias, layer_width)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """What the layer holds, by name: the constructor's arguments (``Q4KLinear(**layer.tensors)``)."""
        held = {"blocks": self.blocks, "out_features": torch.tensor([self.out_features], dtype=torch.int64)}
        if self._pad:
            held["in_features"] = torch.tensor([self.in_features], dtype=torch.int64)
        return held if self.bias is None else {**held, "bias": self.bias}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] float32 -> [..., out] float32
        rows = x.reshape(-1, self.in_features).float()
        if self._pad:
            rows = torch.nn.functional.pad(rows, (0, self._pad))
        y = self._linear(rows, self.blocks, self.out_features, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q4_K x int8 rows"


def q4k_reference(x: torch.Tensor, raw: np.ndarray, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What :class:`Q4KLinear` computes, in float64 with torch: each row of ``x`` [..., K] quantised to
    int8 as the kernel does, times the dequantised weights, times the row's scale; [..., N] float64."""
    return quantised_rows_product(x, dequantize_q4k(raw), bias)


def quantised_rows_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` [..., K] times ``weight`` [N, K] (+ ``bias``) in float64, each row of ``x`` first quantised to
    int8 by its own scale as the kernels (and :class:`~marspec.backends.int8.RowwiseInt8Linear`) do:
    the kernels' references; [..., N] float64."""
    rows = x.reshape(-1, x.shape[-1]).float()
    peak = rows.abs().amax(dim=1, keepdim=True).clamp_min(_PEAK_FLOOR)  # [M, 1]
    q = (rows * (127.0 / peak)).round()
    y = (q.double() @ weight.double().T) * (peak.double() / 127.0)
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], -1)
