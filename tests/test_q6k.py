"""The Q6_K x int8 kernel (:mod:`marspec.backends.q6k`): its dequantiser gives gguf-py's values, the
kernel computes what its float64 reference does, a row's output is the same bits whatever rows share
the call and on either of its paths (VNNI, AMX), and the packed form survives a safetensors file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from test_q4k import (
    assert_amx_gives_vnnis_bits,
    assert_rebuilt_from_safetensors,
    assert_rows_independent,
    needs_amx,
    needs_kernel,
    target_gguf,
)

from marspec.backends.q6k import Q6K_BLOCK_BYTES, Q6KLinear, dequantize_q6k, q6k_reference

ROWS = (1, 2, 5, 13, 16, 17, 52, 128)
N, K = 256 + 16 + 3, 512  # two full tiles, one of 16, one of 3 columns


def random_blocks(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random valid Q6_K bytes [rows, cols / 256 * 210]: any code and scale bytes (scales -128..127),
    a finite d."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, Q6K_BLOCK_BYTES), dtype=np.uint8)
    d = rng.uniform(-0.001, 0.001, size=(rows, cols // 256, 1)).astype(np.float16)
    blocks[..., 208:210] = d.view(np.uint8)
    return blocks.reshape(rows, -1)


def assert_close_to(y: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.fixture(scope="module")
def raw() -> np.ndarray:
    return random_blocks(N, K)


@pytest.fixture(scope="module")
def layer(raw: np.ndarray) -> Q6KLinear:
    return Q6KLinear.from_gguf_blocks(raw, torch.randn(N, generator=torch.Generator().manual_seed(1)))


def test_dequantizing_gives_gguf_pys_values(raw: np.ndarray) -> None:
    expected = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q6_K))
    assert torch.equal(dequantize_q6k(raw), expected)
    assert torch.equal(dequantize_q6k(raw, rows_per_chunk=7), expected)  # a chunk of rows at a time


@needs_kernel
@pytest.mark.parametrize("m", ROWS)
def test_the_kernel_computes_its_reference(raw: np.ndarray, layer: Q6KLinear, m: int) -> None:
    x = torch.randn(m, K) * 3
    x[m // 2] = 0  # an all-zero row stays finite: zeros plus the bias
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (m, N)
    assert_close_to(y, q6k_reference(x, raw, layer.bias))
    assert torch.equal(y[m // 2], layer.bias)


@needs_kernel
def test_extreme_codes_and_scales_sum_exactly() -> None:
    # Every code 63 (or 0) against scales -128 and activations +-127: the int32 sums' largest magnitudes.
    raw = random_blocks(40, 1024, seed=3).reshape(40, 4, Q6K_BLOCK_BYTES)
    raw[:20, :, :192] = 0xFF  # q = 63
    raw[20:, :, :192] = 0x00  # q = 0
    raw[..., 192:208] = 0x80  # sc = -128
    raw = raw.reshape(40, -1)
    x = torch.full((3, 1024), 5.0)
    x[1] = -5.0
    assert_close_to(Q6KLinear.from_gguf_blocks(raw)(x), q6k_reference(x, raw))


@needs_amx
@pytest.mark.parametrize("m", [1, 3, 8, 13, 16, 17, 40])
def test_the_amx_path_gives_the_vnni_paths_bits(layer: Q6KLinear, m: int) -> None:
    assert_amx_gives_vnnis_bits(layer, torch.randn(m, K) * 3)


@needs_amx
@pytest.mark.parametrize("code", [0x00, 0xFF])
@pytest.mark.parametrize("scale", [0x80, 0x7F])
def test_extreme_codes_and_scales_sum_exactly_on_the_amx_path(code: int, scale: int) -> None:
    # sc * (q - 32) at its ends (-128 * -32 = 4096, -128 * 31, 127 * -32, 127 * 31): the AMX path splits
    # it into a low byte 0..255 and a signed high byte.
    raw = random_blocks(40, 1024, seed=4).reshape(40, 4, Q6K_BLOCK_BYTES)
    raw[..., :192] = code
    raw[..., 192:208] = scale
    raw = raw.reshape(40, -1)
    layer = Q6KLinear.from_gguf_blocks(raw)
    x = torch.full((9, 1024), 5.0)
    x[1::2] = -5.0
    assert_amx_gives_vnnis_bits(layer, x)
    assert_close_to(layer(x), q6k_reference(x, raw))


@needs_kernel
def test_a_wider_layer_without_bias_computes_its_reference() -> None:
    raw = random_blocks(1536 + 8, 1536, seed=2)
    layer = Q6KLinear.from_gguf_blocks(raw)
    x = torch.randn(2, 5, 1536)
    assert_close_to(layer(x), q6k_reference(x, raw))


@needs_kernel
@pytest.mark.parametrize("m", [2, 6, 7, 13, 17, 52, 128])
def test_a_rows_output_is_the_same_bits_whatever_rows_share_the_call(layer: Q6KLinear, m: int) -> None:
    assert_rows_independent(layer, torch.randn(m, K))


@needs_kernel
def test_the_packed_tensors_rebuild_the_layer_from_a_safetensors_file(
    layer: Q6KLinear, tmp_path: Path
) -> None:
    assert (layer.in_features, layer.out_features) == (K, N)
    assert_rebuilt_from_safetensors(layer, tmp_path)
    assert "bias" not in Q6KLinear(layer.blocks, N).tensors


@pytest.mark.real
@needs_kernel
def test_the_real_targets_q6k_weights_dequantize_as_gguf_py_and_multiply_as_the_reference(
    tmp_path: Path,
) -> None:
    tensors = [
        t for t in GGUFReader(target_gguf(tmp_path)).tensors if t.tensor_type == GGMLQuantizationType.Q6_K
    ]
    widths = {int(t.shape[0]) for t in tensors}  # gguf lists a tensor's shape innermost first
    assert widths >= {1536, 8960}  # the LM head / embedding and attn_v (1536), ffn_down (8960)
    for width in sorted(widths):
        tensor = next(t for t in tensors if int(t.shape[0]) == width)
        raw = np.asarray(tensor.data)[:300]  # [out, in / 256 * 210]: a few hundred rows keep it fast
        weights = dequantize_q6k(raw)
        assert torch.equal(weights, torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q6_K)))
        layer = Q6KLinear.from_gguf_blocks(raw)
        x = torch.randn(13, width)
        assert_close_to(layer(x), q6k_reference(x, raw))
        assert torch.equal(layer(x)[5], layer(x[5:6])[0])
