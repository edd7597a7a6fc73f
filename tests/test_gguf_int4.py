"""A known model's 4-bit path reads its GGUF and never writes or loads its float32 weights, and builds the
same 4-bit model, bit for bit, as quantising the float32 conversion (issue 57, item 4); a later 4-bit load
reads back the model the first one stored in the folder (:mod:`marspec.models.int4_cache`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from test_models import write_tiny_gguf
from transformers import PreTrainedTokenizerBase

from marspec.api import Decoder
from marspec.backends.int4 import Int4Linear, int4_available, quantize_int4
from marspec.backends.int8 import Int8Embedding, rowwise_int8_available, use_int8_embedding
from marspec.errors import MarspecError
from marspec.models import MODELS, gguf_int4, int4_cache, loading
from marspec.models.cache import GGUF_FILE, WEIGHTS_FILE, check_cached_folder, held_gguf
from marspec.models.convert import float_model_dir, resolve_model_dir
from marspec.models.int4_cache import int4_model_file, read_int4_model
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
    assert_same_4bit_model(direct, quantize_int4(floats), tokenizer, dtype)


def assert_same_4bit_model(
    a: torch.nn.Module, b: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype
) -> None:
    """``a`` and ``b`` hold the same 4-bit layers and other weights, bit for bit, and answer alike."""
    assert_same_4bit_weights(a, b, dtype)
    ids = tokenizer("hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
    assert a.generation_config.eos_token_id == b.generation_config.eos_token_id


def assert_same_4bit_weights(a: torch.nn.Module, b: torch.nn.Module, dtype: torch.dtype) -> None:
    """``a`` and ``b`` hold the same 4-bit layers and other weights (in ``dtype``), bit for bit."""
    a_layers, b_layers = _int4_layers(a), _int4_layers(b)
    assert a_layers.keys() == b_layers.keys() and "lm_head" in a_layers
    for name, layer in a_layers.items():
        theirs = b_layers[name].tensors
        assert layer.tensors.keys() == theirs.keys(), name
        assert all(torch.equal(t, theirs[leaf]) for leaf, t in layer.tensors.items()), name
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert p.dtype == q.dtype == dtype and torch.equal(p, q), name


def _fail(*args: object, **kwargs: object) -> None:
    raise AssertionError("the stored 4-bit model should have been read")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_later_4bit_load_reads_the_model_the_first_one_stored(
    known: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    built, tokenizer, _ = load_model(known, dtype=dtype, int4_linears=True)
    folder = resolve_model_dir(known)
    assert int4_model_file(folder, dtype).is_file() and held_gguf(folder) is not None
    umask = os.umask(0)
    os.umask(umask)
    assert int4_model_file(folder, dtype).stat().st_mode & 0o777 == 0o666 & ~umask  # safetensors writes 0o600
    with monkeypatch.context() as patched:
        patched.setattr(gguf_int4, "load_gguf_int4", _fail)
        patched.setattr(loading, "quantize_int4", _fail)
        stored, _, _ = load_model(known, dtype=dtype, int4_linears=True)
    assert_same_4bit_model(built, stored, tokenizer, dtype)
    assert not stored.training and not any(p.requires_grad for p in stored.parameters())
    # A float load puts the float32 weights in the GGUF's place; the 4-bit model stored stays the one read.
    load_model(known, dtype=dtype)
    assert held_gguf(folder) is None
    with monkeypatch.context() as patched:
        patched.setattr(loading, "quantize_int4", _fail)
        again, _, _ = load_model(known, dtype=dtype, int4_linears=True)
    assert_same_4bit_model(built, again, tokenizer, dtype)
    # vLLM reads every *.safetensors at a checkpoint folder's top level as weights: only the float32 ones.
    assert [p.name for p in folder.glob("*.safetensors")] == [WEIGHTS_FILE]


def test_a_4bit_model_stored_beside_the_weights_is_moved_into_its_own_folder(known: str) -> None:
    """Where marspec stored it before, `vllm serve` took it for a weights file: the next store removes it."""
    folder = float_model_dir(known)
    beside = folder / "int4-float32.safetensors"
    beside.write_bytes(b"stored by an earlier marspec")
    load_model(known, int4_linears=True)
    assert not beside.exists() and int4_model_file(folder, torch.float32).is_file()
    assert [p.name for p in folder.glob("*.safetensors")] == [WEIGHTS_FILE]


def test_a_4bit_model_stored_by_another_torch_or_damaged_is_built_and_stored_again(
    known: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    built, tokenizer, _ = load_model(known, int4_linears=True)
    folder = resolve_model_dir(known)
    path = int4_model_file(folder, torch.float32)
    this_key = int4_cache._key()
    with monkeypatch.context() as patched:  # what another torch release would have written
        patched.setattr(int4_cache, "_key", lambda: this_key | {"torch": "0.0.1"})
        load_model(known, int4_linears=True)
    assert read_int4_model(folder, torch.float32) is None
    again, _, _ = load_model(known, int4_linears=True)
    assert read_int4_model(folder, torch.float32) is not None  # written again, by this torch
    assert_same_4bit_model(built, again, tokenizer, torch.float32)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    again, _, _ = load_model(known, int4_linears=True)
    assert_same_4bit_model(built, again, tokenizer, torch.float32)
    assert read_int4_model(folder, torch.float32) is not None


def test_a_failed_store_is_logged_and_the_load_goes_on(
    known: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", disk_full)
    model, _, _ = load_model(known, int4_linears=True)
    assert _int4_layers(model)
    folder = resolve_model_dir(known)
    assert not list(int4_model_file(folder, torch.float32).parent.iterdir())  # no file, nor a partial one
    assert "could not store the 4-bit model" in caplog.text and "No space left on device" in caplog.text


def test_a_folder_outside_the_cache_is_quantised_and_nothing_is_written_in_it(
    known: str, tmp_path: Path
) -> None:
    user_folder = shutil.copytree(float_model_dir(known), tmp_path / "user-model")
    before = sorted(user_folder.iterdir())
    model, tokenizer, _ = load_model(user_folder, int4_linears=True)
    assert sorted(user_folder.iterdir()) == before
    built, _, _ = load_model(known, int4_linears=True)
    assert_same_4bit_model(built, model, tokenizer, torch.float32)


def test_a_4bit_pair_of_a_known_model_needs_no_float_weights_and_strict_equals_plain(known: str) -> None:
    decoder = Decoder(known, known, target_quant="int4", draft_quant="int4")
    assert not (resolve_model_dir(known) / WEIGHTS_FILE).exists()
    plain = decoder.generate("hello world", rule="plain", max_new_tokens=12).token_ids
    assert len(plain) > 1
    for rule, theta in (("strict", None), ("mars", 1.0)):
        assert (
            decoder.generate("hello world", rule=rule, theta=theta, k=3, max_new_tokens=12).token_ids == plain
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_drafts_4bit_form_has_an_int8_embedding_stored_apart_and_read_back(
    known: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    built, tokenizer, _ = load_model(known, dtype=dtype, int4_linears=True, int8_embedding=True)
    embedding = built.get_input_embeddings()
    assert isinstance(embedding, Int8Embedding) and embedding.lookup_dtype == dtype
    assert isinstance(built.get_output_embeddings(), Int4Linear)  # tied or not: the head as it was
    folder = resolve_model_dir(known)
    assert int4_model_file(folder, dtype, int8_embedding=True).is_file()
    assert not int4_model_file(folder, dtype).exists()  # the other form (a 4-bit target's) is its own file
    with monkeypatch.context() as patched:
        patched.setattr(gguf_int4, "load_gguf_int4", _fail)
        patched.setattr(loading, "quantize_int4", _fail)
        stored, _, _ = load_model(known, dtype=dtype, int4_linears=True, int8_embedding=True)
    assert_same_4bit_model(built, stored, tokenizer, dtype)
    theirs = stored.get_input_embeddings()
    assert isinstance(theirs, Int8Embedding) and theirs.lookup_dtype == dtype
    assert all(torch.equal(t, theirs.tensors[leaf]) for leaf, t in embedding.tensors.items())
    # The same model as the float32 conversion quantised so (what quantize_draft makes of a float draft).
    floats, _, _ = load_model(known, dtype=dtype)
    quantize_int4(floats)
    use_int8_embedding(floats)
    assert_same_4bit_model(built, floats, tokenizer, dtype)
    # A plain 4-bit load of the same folder keeps its float embedding.
    plain, _, _ = load_model(known, dtype=dtype, int4_linears=True)
    assert type(plain.get_input_embeddings()) is torch.nn.Embedding


@pytest.mark.parametrize(
    "form",
    [{"int8_linears": True}, {"int4_linears": True}, {"int4_linears": True, "int8_embedding": True}],
    ids=["int8", "int4", "int4-draft"],
)
def test_a_load_that_releases_the_gguf_leaves_its_stored_form_and_the_gguf_is_assembled_again_when_needed(
    known: str, form: dict[str, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    if form.get("int8_linears") and not rowwise_int8_available():
        pytest.skip("no oneDNN int8 kernels on this CPU")
    first, tokenizer, _ = load_model(known, keep_gguf=False, **form)
    folder = resolve_model_dir(known)
    assert held_gguf(folder) is None and not (folder / WEIGHTS_FILE).exists()
    check_cached_folder(folder)  # complete as it is
    with monkeypatch.context() as patched:  # a later load of the form reads it back: no GGUF, no package
        patched.setitem(MODELS, known, _unassemblable(MODELS[known]))
        again, _, _ = load_model(known, keep_gguf=False, **form)
    ids = tokenizer("hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(first(ids).logits, again(ids).logits)
    # Another form assembles the GGUF again from the packages, and stored, releases it again.
    other = not form.get("int8_embedding", False)
    load_model(known, int4_linears=True, int8_embedding=other, keep_gguf=False)
    assert int4_model_file(folder, torch.float32, other).is_file() and held_gguf(folder) is None
    # So does a float load, whose float32 weights stay.
    load_model(known)
    assert (folder / WEIGHTS_FILE).is_file() and held_gguf(folder) is None


def _unassemblable(spec: ModelSpec) -> ModelSpec:
    """``spec`` whose GGUF cannot be assembled (its packages gone)."""
    from dataclasses import replace

    return replace(spec, modules=("marspec_no_such_module",), requirements=("gone==1.0",))


def test_a_released_gguf_whose_packages_are_gone_is_named_with_the_command_that_installs_them(
    known: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_model(known, int4_linears=True, keep_gguf=False)
    monkeypatch.setitem(MODELS, known, _unassemblable(MODELS[known]))
    load_model(known, int4_linears=True)  # the stored form needs no package
    with pytest.raises(MarspecError, match=r"gone==1\.0"):
        load_model(known)


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
