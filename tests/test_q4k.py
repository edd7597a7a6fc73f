"""The Q4_K x int8 kernel (:mod:`marspec.backends.q4k`): its dequantiser gives gguf-py's values, the
kernel computes what its float64 reference does, a row's output is the same bits whatever rows share
the call and on either of its paths (VNNI, AMX), and the packed form survives a safetensors file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

from marspec.backends import kernels, q4k
from marspec.backends.kernels import amx_available, amx_from_rows, kernels_available
from marspec.backends.q4k import (
    BLOCK_BYTES,
    Q4KLinear,
    dequantize_q4k,
    q4k_blocks,
    q4k_reference,
)
from marspec.errors import MarspecError
from marspec.models import DEFAULT_TARGET
from marspec.models.cache import held_gguf, models_root
from marspec.models.registry import MODELS, missing_requirements

needs_kernel = pytest.mark.skipif(
    not kernels_available(), reason=f"no CPU kernels here: {kernels.unavailable_reason()}"
)

ROWS = (1, 2, 5, 13, 16, 17, 52, 128)
N, K = 256 + 16 + 3, 512  # two full tiles, one of 16, one of 3 columns


def random_blocks(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random valid Q4_K bytes [rows, cols / 256 * 144]: any scale and code bytes, finite d and dmin."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, BLOCK_BYTES), dtype=np.uint8)
    halves = rng.uniform(0, 0.01, size=(rows, cols // 256, 2)).astype(np.float16)
    blocks[..., 0:4] = halves.view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def raw() -> np.ndarray:
    return random_blocks(N, K)


@pytest.fixture(scope="module")
def layer(raw: np.ndarray) -> Q4KLinear:
    return Q4KLinear.from_gguf_blocks(raw, torch.randn(N, generator=torch.Generator().manual_seed(1)))


def test_dequantizing_gives_gguf_pys_values(raw: np.ndarray) -> None:
    expected = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K))
    assert torch.equal(dequantize_q4k(raw), expected)
    assert torch.equal(dequantize_q4k(raw, rows_per_chunk=7), expected)  # a chunk of rows at a time


def test_quantising_float_weights_keeps_them_within_a_few_steps_of_their_range() -> None:
    weight = torch.randn(48, 512)
    restored = dequantize_q4k(q4k_blocks(weight))
    sub_blocks = weight.reshape(48, -1, 32)
    step = (sub_blocks.amax(-1) - sub_blocks.amin(-1).clamp_max(0)) / 15  # [48, 16]
    error = (restored - weight).abs().reshape(48, -1, 32).amax(-1)
    assert (error <= 1.5 * step).all()
    assert (restored - weight).abs().mean() < 0.1 * weight.abs().mean()


@needs_kernel
@pytest.mark.parametrize("m", ROWS)
def test_the_kernel_computes_its_reference(raw: np.ndarray, layer: Q4KLinear, m: int) -> None:
    x = torch.randn(m, K) * 3
    x[m // 2] = 0  # an all-zero row stays finite: zeros plus the bias
    expected = q4k_reference(x, raw, layer.bias)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (m, N)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert torch.equal(y[m // 2], layer.bias)


@needs_kernel
def test_a_wider_layer_without_bias_computes_its_reference() -> None:
    raw = random_blocks(1536 + 8, 1536, seed=2)
    layer = Q4KLinear.from_gguf_blocks(raw)
    x = torch.randn(2, 5, 1536)
    expected = q4k_reference(x, raw)
    torch.testing.assert_close(
        layer(x).double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item()
    )


@needs_kernel
@pytest.mark.parametrize(("width", "m"), [(896, 1), (896, 13), (300, 3), (32, 2), (288, 7)])
def test_a_narrow_layer_stores_no_padding_and_gives_the_padded_layers_bits(width: int, m: int) -> None:
    # A width that is not a multiple of 256 leaves the last super-block part empty: its record keeps
    # only the sub-blocks that hold weights, and the layer computes what the same weights padded with
    # zeros to whole super-blocks compute on inputs padded with zeros.
    weight, bias = torch.randn(70, width) * 0.1, torch.randn(70)
    layer = Q4KLinear.from_float(weight, bias)
    padding = -width % 256
    padded = Q4KLinear.from_gguf_blocks(q4k_blocks(torch.nn.functional.pad(weight, (0, padding))), bias)
    x = torch.randn(m, width)
    assert torch.equal(layer(x), padded(torch.nn.functional.pad(x, (0, padding))))
    tiles = 3  # 70 output columns
    assert layer.blocks.shape == (tiles, q4k.tile_bytes(-(-width // 32) * 32))
    assert layer.blocks.numel() < padded.blocks.numel()


def test_a_tiles_bytes_give_back_its_width() -> None:
    for width in range(32, 2048 + 1, 32):
        assert q4k.kernel_width(torch.empty(1, q4k.tile_bytes(width), dtype=torch.uint8)) == width
    with pytest.raises(MarspecError, match="not whole tiles"):
        q4k.kernel_width(torch.empty(1, q4k.tile_bytes(896) + 1, dtype=torch.uint8))


def assert_rows_independent(layer: torch.nn.Module, x: torch.Tensor) -> None:
    """Each row of ``layer(x)`` is the same bits as the row alone gives, and as a call from row 3 on."""
    together = layer(x)
    for i in range(x.shape[0]):
        assert torch.equal(together[i], layer(x[i : i + 1])[0]), f"row {i} of {x.shape[0]}"
    assert torch.equal(together[3:], layer(x[3:]))  # a row block starting elsewhere


def cpu_has_amx_int8() -> bool:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return {"amx_tile", "amx_int8"} <= flags


needs_amx = pytest.mark.skipif(
    not (kernels_available() and amx_available()), reason="no AMX int8 tiles here (or no kernels' library)"
)


def assert_amx_gives_vnnis_bits(layer: torch.nn.Module, x: torch.Tensor) -> None:
    """``layer(x)`` is the same bits on the AMX path as on the VNNI path, and so is each row alone."""
    with amx_from_rows(1):
        amx = layer(x)
        amx_rows = [layer(x[i : i + 1]) for i in range(x.shape[0])]
    with amx_from_rows(0):
        vnni = layer(x)
    assert torch.equal(amx, vnni), f"{x.shape[0]} rows: largest difference {(amx - vnni).abs().max()}"
    assert torch.equal(torch.cat(amx_rows), vnni)


def assert_rebuilt_from_safetensors(layer: torch.nn.Module, tmp_path: Path) -> None:
    """``type(layer)(**tensors)``, its tensors saved to and loaded from a safetensors file, is the layer."""
    save_file(layer.tensors, tmp_path / "layer.safetensors")
    rebuilt = type(layer)(**load_file(tmp_path / "layer.safetensors"))
    x = torch.randn(3, layer.in_features)
    assert (rebuilt.in_features, rebuilt.out_features) == (layer.in_features, layer.out_features)
    assert torch.equal(rebuilt(x), layer(x))


@needs_kernel
@pytest.mark.parametrize("m", [2, 8, 9, 13, 17, 52, 128])
def test_a_rows_output_is_the_same_bits_whatever_rows_share_the_call(layer: Q4KLinear, m: int) -> None:
    assert_rows_independent(layer, torch.randn(m, K))


@needs_kernel
def test_amx_is_available_wherever_the_cpu_has_amx_int8() -> None:
    # The AMX path is asked for by the CPU's flags and Linux's permission; a build or a check that
    # silently lost it would leave such a CPU on the slower VNNI path at many rows.
    assert amx_available() == cpu_has_amx_int8()


@needs_kernel
def test_amx_from_rows_restores_the_settings_before() -> None:
    defaults = kernels.ops().amx_set_min_rows(8, 8)
    assert defaults == [8, 8]  # the kernels' own (kernels/amx.h), which amx_from_rows documents
    with amx_from_rows(3):
        with amx_from_rows(0, 5):
            assert kernels.ops().amx_set_min_rows(0, 5) == [0, 5]
        assert kernels.ops().amx_set_min_rows(3, 3) == [3, 3]
    assert kernels.ops().amx_set_min_rows(8, 8) == [8, 8]


@needs_amx
@pytest.mark.parametrize("m", [1, 3, 8, 13, 16, 17, 40])
def test_the_amx_path_gives_the_vnni_paths_bits(layer: Q4KLinear, m: int) -> None:
    assert_amx_gives_vnnis_bits(layer, torch.randn(m, K) * 3)


@needs_amx
@pytest.mark.parametrize("width", [896, 288, 32])
def test_the_amx_path_gives_the_vnni_paths_bits_on_a_part_empty_last_super_block(width: int) -> None:
    # 896 leaves 4 of the last super-block's 8 sub-blocks, 288 and 32 one: a tile product then covers one
    # sub-block that holds weights and one that does not.
    layer = Q4KLinear.from_float(torch.randn(40, width) * 0.1, torch.randn(40))
    assert_amx_gives_vnnis_bits(layer, torch.randn(13, width))


@needs_amx
def test_extreme_codes_scales_and_activations_sum_exactly_on_the_amx_path() -> None:
    # Every code 15, every scale and min 63, activations at +-127 after quantisation: the largest sums
    # of the AMX path's split scales (sc = 8 * hi + lo, each product at most 105).
    raw = random_blocks(64, 1024, seed=3).reshape(64, 4, BLOCK_BYTES)
    raw[..., 4:] = 0xFF
    layer = Q4KLinear.from_gguf_blocks(raw.reshape(64, -1))
    x = torch.full((9, 1024), 5.0)
    x[1::2] = -5.0
    assert_amx_gives_vnnis_bits(layer, x)
    expected = q4k_reference(x, raw.reshape(64, -1))
    with amx_from_rows(1):
        y = layer(x)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@needs_kernel
def test_the_packed_tensors_rebuild_the_layer_from_a_safetensors_file(
    layer: Q4KLinear, tmp_path: Path
) -> None:
    assert (layer.in_features, layer.out_features) == (K, N)
    assert_rebuilt_from_safetensors(layer, tmp_path)


def test_a_kernel_that_does_not_compile_says_why_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from marspec.backends.kernels.build import BuildError, load_library

    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setenv("MARSPEC_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(BuildError) as raised:
        load_library("marspec_broken", (broken,), ("-O0",), label="test kernels")
    message = str(raised.value)
    assert "\n" not in message and "broken.cpp" in message  # one line, whatever the compiler printed
    assert "error" in message.split("failed")[1]  # the compiler's error, not its command line
    assert "building the CPU test kernels" in capsys.readouterr().err  # the build said so, and how it ended
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))


def target_gguf(tmp_path: Path) -> Path:
    """The default target's GGUF: the one its cached folder holds, else assembled from its packages."""
    held = held_gguf(models_root() / DEFAULT_TARGET)
    if held is not None:
        return held
    spec = MODELS[DEFAULT_TARGET]
    if missing_requirements(spec):
        pytest.skip(f"{DEFAULT_TARGET}'s packages are not installed")
    spec.write_gguf(tmp_path / "target.gguf")
    return tmp_path / "target.gguf"


@pytest.mark.real
@needs_kernel
def test_the_real_targets_q4k_weights_dequantize_as_gguf_py_and_multiply_as_the_reference(
    tmp_path: Path,
) -> None:
    tensor = next(t for t in GGUFReader(target_gguf(tmp_path)).tensors if t.name == "blk.0.ffn_gate.weight")
    assert tensor.tensor_type == GGMLQuantizationType.Q4_K
    raw = np.asarray(tensor.data)  # [out, in / 256 * 144]
    assert torch.equal(dequantize_q4k(raw), torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K)))
    layer = Q4KLinear.from_gguf_blocks(raw)
    x = torch.randn(13, layer.in_features)
    expected = q4k_reference(x, raw)
    torch.testing.assert_close(
        layer(x).double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item()
    )
    assert torch.equal(layer(x)[5], layer(x[5:6])[0])
