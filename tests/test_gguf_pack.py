"""The kernels' packing of GGUF Q4_K and Q6_K blocks into their records (kernels/pack_core.h): byte for
byte the numpy packing (marspec/backends/q4k.py, q6k.py) on random blocks of several shapes, a layer
narrower than its blocks, and a packaged model's real tensors; the numpy packing where the kernels are
not ready."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from test_gguf_dequantize import random_blocks

from marspec.backends import kernels, q4k, q6k

needs_kernels = pytest.mark.skipif(
    not kernels.kernels_available(), reason=f"no CPU kernels here: {kernels.unavailable_reason()}"
)
Q = gguf.GGMLQuantizationType
PACKERS = {Q.Q4_K: q4k._pack, Q.Q6_K: q6k._pack}


def numpy_packed(monkeypatch: pytest.MonkeyPatch, qtype: Q, raw: np.ndarray, *args: int) -> torch.Tensor:
    """``raw``'s records from the numpy packing (the kernels made to look not ready)."""
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "library_ready", lambda: False)
        return PACKERS[qtype](raw, *args)


@needs_kernels
@pytest.mark.parametrize("qtype", list(PACKERS), ids=[q.name for q in PACKERS])
@pytest.mark.parametrize("shape", [(45, 3), (32, 1), (1, 2), (70, 1)], ids=["ragged", "tile", "one", "three"])
def test_the_kernels_pack_the_bytes_numpy_packs(monkeypatch: pytest.MonkeyPatch, qtype: Q, shape) -> None:
    raw = random_blocks(qtype, shape, seed=shape[0])
    ours, theirs = PACKERS[qtype](raw), numpy_packed(monkeypatch, qtype, raw)
    assert ours.dtype == torch.uint8 and ours.shape == theirs.shape
    assert torch.equal(ours, theirs)


@needs_kernels
def test_a_layer_narrower_than_its_blocks_keeps_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """896 weights wide in 1,024-weight rows (the draft's width): the last record's unused codes dropped."""
    raw = random_blocks(Q.Q4_K, (40, 4), seed=3)
    ours, theirs = q4k._pack(raw, 896), numpy_packed(monkeypatch, Q.Q4_K, raw, 896)
    assert ours.shape == theirs.shape == (2, q4k.tile_bytes(896))
    assert torch.equal(ours, theirs)


@needs_kernels
def test_the_operator_refuses_what_it_cannot_pack_in_one_line() -> None:
    ops = kernels.ops()
    with pytest.raises(RuntimeError, match="ggml type 8 is not one gguf_pack_tiles takes"):
        ops.gguf_pack_tiles(torch.zeros(2, 34, dtype=torch.uint8), int(Q.Q8_0))
    with pytest.raises(RuntimeError, match="not whole blocks of 210"):
        ops.gguf_pack_tiles(torch.zeros(2, 211, dtype=torch.uint8), int(Q.Q6_K))
    with pytest.raises(RuntimeError, match="must be uint8"):
        ops.gguf_pack_tiles(torch.zeros(2, 144), int(Q.Q4_K))


@needs_kernels
@pytest.mark.real
def test_the_default_drafts_blocks_pack_to_the_numpy_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packaged Qwen2.5-Coder-0.5B Q4_K_M GGUF: its first Q4_K and first Q6_K tensor."""
    from marspec.models import DEFAULT_DRAFT, resolve_model_dir
    from marspec.models.convert import folder_gguf
    from marspec.models.gguf_parse import gguf_reader

    path = folder_gguf(resolve_model_dir(DEFAULT_DRAFT), blocks_wanted=True)
    assert path is not None
    checked = set()
    for tensor in gguf_reader(path).tensors:
        if tensor.tensor_type in PACKERS and tensor.tensor_type not in checked and tensor.data.ndim == 2:
            raw = np.asarray(tensor.data)
            ours = PACKERS[tensor.tensor_type](raw)
            assert torch.equal(ours, numpy_packed(monkeypatch, tensor.tensor_type, raw)), tensor.name
            checked.add(tensor.tensor_type)
    assert checked == set(PACKERS)
