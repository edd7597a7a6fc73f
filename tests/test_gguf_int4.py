"""A known model's 4-bit path reads its GGUF and never writes or loads its float32 weights, and builds the
same 4-bit model, bit for bit, as quantising the float32 conversion (issue 57, item 4)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_models import write_tiny_gguf

from marspec.api import Decoder
from marspec.backends.int4 import Int4Linear, int4_available, quantize_int4
from marspec.models import MODELS
from marspec.models.cache import GGUF_FILE, WEIGHTS_FILE
from marspec.models.convert import float_model_dir, resolve_model_dir
from marspec.models.loading import load_model
from marspec.models.registry import ModelSpec

pytestmark = pytest.mark.skipif(not int4_available(), reason="this torch build has no int4 CPU kernels")

NAME = "tiny-known-gguf"


@pytest.fixture(params=["untied", "tied"])
def known(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A known model (as the packaged ones are) whose GGUF is the tiny llama; tied: without an output
    layer, so its head reads the input embedding."""
    monkeypatch.setenv("MARSPEC_CACHE_DIR", str(tmp_path / "cache"))
    skip = "output.weight" if request.param == "tied" else None
    return register_known(monkeypatch, write_tiny_gguf(tmp_path / "source.gguf", skip=skip))


def register_known(monkeypatch: pytest.MonkeyPatch, source: Path) -> str:
    """Make the GGUF file ``source`` the known model NAME for the test, and return NAME."""
    spec = ModelSpec(
        name=NAME,
        description="tiny test llama",
        instruct=True,
        requirements=(),
        install_command="",
        modules=(),
        write_gguf=lambda out: shutil.copyfile(source, out),
    )
    monkeypatch.setitem(MODELS, NAME, spec)
    return NAME


def _int4_layers(model: torch.nn.Module) -> dict[str, Int4Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}


def test_a_known_model_is_prepared_with_its_gguf_and_no_float_weights(known: str) -> None:
    folder = resolve_model_dir(known)
    assert (folder / GGUF_FILE).is_file() and not (folder / WEIGHTS_FILE).exists()
    assert resolve_model_dir(known) == folder  # prepared once, and complete as it is
    assert float_model_dir(known) == folder and (folder / WEIGHTS_FILE).is_file()  # for vLLM and others
    assert not (folder / GGUF_FILE).exists()  # the float32 weights took its place
    assert resolve_model_dir(known) == folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gguf_path_builds_the_same_4bit_model_as_quantising_the_float32_one(
    known: str, dtype: torch.dtype
) -> None:
    direct, tokenizer, _ = load_model(known, dtype=dtype, int4_linears=True)
    folder = resolve_model_dir(known)
    assert not (folder / WEIGHTS_FILE).exists()  # the 4-bit path wrote no float32 weights
    assert not any(type(m) is torch.nn.Linear for m in direct.modules())
    floats, _, _ = load_model(known, dtype=dtype)  # a float load writes them now, once
    assert (folder / WEIGHTS_FILE).is_file() and not (folder / GGUF_FILE).exists()
    quantized = quantize_int4(floats)
    a, b = _int4_layers(direct), _int4_layers(quantized)
    assert a.keys() == b.keys() and "lm_head" in a
    for name in a:
        assert torch.equal(a[name].packed_weight, b[name].packed_weight), name
        assert torch.equal(a[name].scale_and_zeros, b[name].scale_and_zeros), name
    for (name, p), (_, q) in zip(direct.named_parameters(), quantized.named_parameters(), strict=True):
        assert p.dtype == q.dtype == dtype and torch.equal(p, q), name
    ids = tokenizer("hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, quantized(ids).logits)
    assert direct.generation_config.eos_token_id == quantized.generation_config.eos_token_id
    # From then on the 4-bit path loads the float32 weights, for the caller to quantise: the same model.
    again, _, _ = load_model(known, dtype=dtype, int4_linears=True)
    assert torch.equal(quantize_int4(again).lm_head.packed_weight, a["lm_head"].packed_weight)


def test_a_4bit_pair_of_a_known_model_needs_no_float_weights_and_strict_equals_plain(known: str) -> None:
    decoder = Decoder(known, known, target_quant="int4", draft_quant="int4")
    assert not (resolve_model_dir(known) / WEIGHTS_FILE).exists()
    plain = decoder.generate("hello world", rule="plain", max_new_tokens=12).token_ids
    assert len(plain) > 1
    for rule, theta in (("strict", None), ("mars", 1.0)):
        assert (
            decoder.generate("hello world", rule=rule, theta=theta, k=3, max_new_tokens=12).token_ids == plain
        )


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "F16"])
def test_dequantizing_a_chunk_of_rows_at_a_time_gives_the_whole_tensors_values(qtype: str) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize
    from gguf.quants import quantize

    from marspec.models.gguf_weights import dequantized

    kind = GGMLQuantizationType[qtype]
    data = quantize(np.random.default_rng(0).standard_normal((37, 64)).astype(np.float32), kind)
    whole = dequantize(data, kind)
    for chunk in (1, 5, 36, 37, 100):
        assert np.array_equal(dequantized(data, kind, rows_per_chunk=chunk), whole)
