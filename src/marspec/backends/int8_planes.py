"""Int8 rows on the Q4_K kernel: a layer's int8 weights run as two 4-bit code planes, their values kept.

A GGUF layer of a type the kernels do not read (Q5_0, Q8_0, float: Gemma 3's 640-wide layers and its
output layer, a Q4_K_M file's Q5_K fused q/k/v) is stored as int8 rows, one scale per output row
(:func:`marspec.backends.int8.int8_rows`). Each weight ``w`` in [-127, 127] is written exactly as
``16 * h + l - 128`` with 4-bit ``h`` and ``l``, so a row's product with an activation row ``x`` is

    s * sum(w x) = s * (16 sum(h x) + sum(l x) - 128 sum(x))

which is a Q4_K row twice as wide, over the input written twice (``[x, x]``): the ``h`` plane with
sub-block scale 16, the ``l`` plane with scale 1, ``d = s`` and the mins making up ``128 * sum(x)``
(63 on the ``h`` plane's sub-blocks and 1 on the ``l`` plane's, ``dmin = 2 s``). The integer sums are
exact, so the product is the int8 rows' own, computed by marspec's kernel instead of oneDNN: each row
alone (strict decoding's bits in any batch), on every CPU path the kernels run (oneDNN's int8 path is
x86 only), at the kernel's streaming rate, for 19% more bytes than the int8 rows (4.75 bits a code).
"""

from __future__ import annotations

import numpy as np
import torch

from marspec.backends import kernels
from marspec.backends.q4k import SUB_BLOCK, SUPER_BLOCK, TILE, Q4KFields, kernel_width, pack_fields
from marspec.errors import MarspecError

_PLANE_ALIGN = SUPER_BLOCK // 2  # a plane's width, so that the two planes are whole super-blocks
_HIGH_SCALE, _LOW_SCALE = 16, 1
_HIGH_MIN, _LOW_MIN = 63, 1  # their sum times dmin = 2 s is the offset's 128 s
_ROWS_PER_CHUNK = 4096  # rows packed at a time (a multiple of TILE): bounds the temporaries


def plane_fields(int8: np.ndarray, scale: np.ndarray) -> Q4KFields:
    """The Q4_K fields of int8 rows [N, K] (K a multiple of 128) with scales [N]: rows 2K wide, the high
    nibbles of ``w + 128`` then the low ones."""
    rows, width = int8.shape
    shifted = (int8.astype(np.int16) + 128).astype(np.uint8)
    q = np.concatenate([shifted >> 4, shifted & 0x0F], axis=1)  # [N, 2K]
    subs = 2 * width // SUB_BLOCK
    high = np.arange(subs) < subs // 2  # the sub-blocks of the first plane
    sc = np.where(high, _HIGH_SCALE, _LOW_SCALE).astype(np.uint8)
    m = np.where(high, _HIGH_MIN, _LOW_MIN).astype(np.uint8)
    supers = 2 * width // SUPER_BLOCK
    shape = (rows, supers, SUPER_BLOCK // SUB_BLOCK)
    sc, m = np.broadcast_to(sc.reshape(shape[1:]), shape), np.broadcast_to(m.reshape(shape[1:]), shape)
    d = np.repeat(scale.astype(np.float32)[:, None], supers, axis=1)
    return Q4KFields(d, 2.0 * d, sc, m, q)


class Int8PlanesLinear(torch.nn.Module):
    """``nn.Linear`` on int8 rows (one scale per output row) run by the Q4_K kernel as two 4-bit planes
    (the module's docstring), with int8 activations, one scale per token row (inference only; needs
    :func:`marspec.backends.kernels.kernels_available`). A row's output does not depend on the other rows
    (bit for bit)."""

    def __init__(
        self,
        blocks: torch.Tensor,
        out_features: int | torch.Tensor,
        in_features: int | torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> None:
        """From the packed planes (:attr:`tensors`; kept, not copied): ``blocks`` uint8 [ceil(N / 32),
        2 K' / 256 records], K' the input width rounded up to 128, ``out_features`` N, ``in_features`` K
        (ints or int64 tensors of one element) and an optional float bias [N]."""
        super().__init__()
        self._linear = kernels.ops().q4k_linear
        self.blocks = blocks.contiguous()
        self.out_features = int(out_features)
        self.in_features = int(in_features)
        self._plane = -(-self.in_features // _PLANE_ALIGN) * _PLANE_ALIGN
        if kernel_width(self.blocks) != 2 * self._plane:
            shape = tuple(blocks.shape)
            raise MarspecError(f"int8 planes {shape} do not fit a layer {self.in_features} wide")
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def from_int8_rows(
        cls, int8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> Int8PlanesLinear:
        """From int8 weights [N, K] and their float32 scales [N]
        (:func:`~marspec.backends.int8.int8_rows`)."""
        rows, width = int8.shape
        plane = -(-width // _PLANE_ALIGN) * _PLANE_ALIGN
        weights = int8.numpy()
        if plane != width:  # zero weights widen each row (and zeros the input): no term added
            weights = np.pad(weights, ((0, 0), (0, plane - width)))
        scales = scale.float().numpy()
        tiles = -(-rows // TILE)
        record_count = 2 * plane // SUPER_BLOCK
        blocks = None
        for start in range(0, rows, _ROWS_PER_CHUNK):
            end = start + _ROWS_PER_CHUNK
            chunk, chunk_scale = weights[start:end], scales[start:end]
            padded = -(-chunk.shape[0] // TILE) * TILE
            if padded != chunk.shape[0]:  # zero rows to whole tiles (their columns are never returned)
                chunk = np.pad(chunk, ((0, padded - chunk.shape[0]), (0, 0)))
                chunk_scale = np.pad(chunk_scale, (0, padded - chunk_scale.shape[0]))
            packed = pack_fields(plane_fields(chunk, chunk_scale))  # [T, S, record]
            if blocks is None:
                blocks = np.empty((tiles, record_count, packed.shape[-1]), dtype=np.uint8)
            blocks[start // TILE : (start + padded) // TILE] = packed
        assert blocks is not None
        return cls(torch.from_numpy(blocks.reshape(tiles, -1)), rows, width, bias)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """What the layer holds, by name: the constructor's arguments
        (``Int8PlanesLinear(**layer.tensors)``)."""
        held = {
            "blocks": self.blocks,
            "out_features": torch.tensor([self.out_features], dtype=torch.int64),
            "in_features": torch.tensor([self.in_features], dtype=torch.int64),
        }
        return held if self.bias is None else {**held, "bias": self.bias}

    @property
    def pad(self) -> int:
        """The zeros each input row is widened by before it is written twice (a plane: a multiple of 128)."""
        return self._plane - self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] float32 -> [..., out] float32
        rows = x.reshape(-1, self.in_features).float()
        if self._plane != self.in_features:
            rows = torch.nn.functional.pad(rows, (0, self._plane - self.in_features))
        y = self._linear(torch.cat([rows, rows], dim=1), self.blocks, self.out_features, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows as Q4_K planes"
