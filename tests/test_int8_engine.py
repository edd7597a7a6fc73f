"""The int8 engine (issue 67): a known model's int8 model is written straight from its GGUF (no float32
weights on disk), is the same model whichever source it was written from, loads back from its stored
file, scores each row of a forward as a one-token forward does, and is what a caller gets on a CPU when
it names no precision (:mod:`marspec.precision`)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_chain_rows_scored_as_one_token_forwards
from safetensors import safe_open
from test_gguf_int4 import register_known
from test_models import write_tiny_gguf

from marspec import precision
from marspec.api import Decoder, load_lm
from marspec.backends.hf import HFCausalLM
from marspec.backends.int8 import Int8Embedding, RowwiseInt8Linear, int8_groups, rowwise_int8_available
from marspec.backends.kernels import kernels_available
from marspec.errors import MarspecError
from marspec.models import int8_store
from marspec.models.cache import GGUF_FILE, WEIGHTS_FILE
from marspec.models.convert import float_model_dir, resolve_model_dir
from marspec.models.gguf_weights import write_safetensors
from marspec.models.int8_store import int8_model_file
from marspec.models.loading import load_model
from marspec.precision import Precision, choose_precision

needs_int8 = pytest.mark.skipif(not rowwise_int8_available(), reason="no oneDNN int8 kernels on this CPU")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(params=["untied", "tied"])
def known(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A known model whose GGUF is the tiny llama; tied: its head reads the input embedding."""
    monkeypatch.setenv("MARSPEC_CACHE_DIR", str(tmp_path / "cache"))
    skip = "output.weight" if request.param == "tied" else None
    return register_known(monkeypatch, write_tiny_gguf(tmp_path / "source.gguf", skip=skip))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@needs_int8
def test_a_known_models_int8_model_is_written_from_its_gguf_without_float_weights(known: str) -> None:
    model, tokenizer, _ = load_model(known, int8_linears=True)
    folder = resolve_model_dir(known)
    assert (folder / GGUF_FILE).is_file() and not (folder / WEIGHTS_FILE).exists()
    assert int8_model_file(folder).is_file()
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert isinstance(model.get_input_embeddings(), Int8Embedding)
    assert isinstance(model.get_output_embeddings(), RowwiseInt8Linear)
    # No float32 matrix is left: what is float32 is vectors (norms, scales, biases).
    assert all(p.dim() == 1 for p in model.parameters())
    with safe_open(int8_model_file(folder), framework="pt") as stored:
        names = set(stored.keys())
    assert {"lm_head.int8_weight", "model.embed_tokens.int8_weight"} <= names  # tied or not
    ids = tokenizer("hello world", return_tensors="pt").input_ids
    assert torch.isfinite(_logits(model, ids)).all()


@needs_int8
def test_the_int8_model_is_the_same_from_the_gguf_and_from_the_float32_weights(known: str) -> None:
    from_gguf, tokenizer, _ = load_model(known, int8_linears=True)
    folder = float_model_dir(known)  # the float32 weights take the GGUF's place
    assert not (folder / GGUF_FILE).exists()
    int8_model_file(folder).unlink()
    from_floats, _, _ = load_model(known, int8_linears=True)
    ids = tokenizer("hello world", return_tensors="pt").input_ids
    assert torch.equal(_logits(from_gguf, ids), _logits(from_floats, ids))
    # ... and its linear layers are the row-wise int8 form of the float32 model's, bit for bit.
    floats, _, _ = load_model(known)
    layer = floats.model.layers[0].mlp.down_proj
    x = torch.randn(3, layer.in_features)
    assert torch.equal(from_floats.model.layers[0].mlp.down_proj(x), RowwiseInt8Linear.of(layer)(x))


@needs_int8
def test_a_later_int8_load_reads_the_stored_model_and_a_damaged_one_is_written_again(
    known: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, tokenizer, _ = load_model(known, int8_linears=True)
    path = int8_model_file(resolve_model_dir(known))
    written = path.stat().st_mtime_ns

    def fail(*args: object) -> None:
        raise AssertionError("the stored int8 model should have been read")

    with monkeypatch.context() as patch:
        patch.setattr(int8_store, "_write", fail)
        again, _, _ = load_model(known, int8_linears=True)
    ids = tokenizer("hello", return_tensors="pt").input_ids
    assert torch.equal(_logits(first, ids), _logits(again, ids)) and path.stat().st_mtime_ns == written
    # Truncated, and renamed into place (the loaded models view the file they mapped: a stored file is
    # only ever replaced, never rewritten in place).
    damaged = path.with_suffix(".damaged")
    damaged.write_bytes(path.read_bytes()[:1000])
    damaged.replace(path)
    rebuilt, _, _ = load_model(known, int8_linears=True)
    assert torch.equal(_logits(first, ids), _logits(rebuilt, ids))


@needs_int8
def test_an_int8_model_scores_each_row_of_a_forward_as_a_one_token_forward(known: str) -> None:
    lm, _ = load_lm(known, torch.float32, int8_linears=True)
    assert_chain_rows_scored_as_one_token_forwards(lm, torch.tensor([5, 17, 42, 8, 63, 5, 17, 42]))


def test_int8_embedding_looks_up_each_row_times_its_group_scales() -> None:
    weight = torch.randn(11, 64)
    int8, scale = int8_groups(weight)
    assert scale.shape == (11, 2)
    embedding = Int8Embedding(int8, scale)
    ids = torch.tensor([[3, 0, 10, 3]])
    looked_up = embedding(ids)
    assert looked_up.shape == (1, 4, 64) and looked_up.dtype == torch.float32
    assert torch.equal(looked_up[0, 1], int8[0].float() * scale[0].repeat_interleave(32))
    assert torch.equal(looked_up[0, 0], looked_up[0, 3])
    assert (looked_up - weight[ids]).abs().max() <= scale.max() / 2 + 1e-6  # within half a step
    assert int8_groups(torch.randn(5, 48))[1].shape == (5, 1)  # not a multiple of 32: one scale a row


def test_write_safetensors_writes_int8_and_float32_arrays_with_metadata(tmp_path: Path) -> None:
    arrays = {"a": np.arange(-5, 5, dtype=np.int8).reshape(2, 5), "b": np.linspace(0, 1, 4, dtype=np.float32)}
    path = tmp_path / "t.safetensors"
    write_safetensors(path, iter(arrays.items()), 2, {"kind": "test"})
    with safe_open(path, framework="np") as f:
        assert f.metadata()["kind"] == "test"
        for name, array in arrays.items():
            assert np.array_equal(f.get_tensor(name), array) and f.get_tensor(name).dtype == array.dtype


@pytest.mark.parametrize(
    ("target", "target_quant", "dtype", "device", "expected"),
    [
        ("qwen2.5-coder-1.5b-instruct", "auto", "auto", CPU, ("int8", "fp32")),
        ("/models/user.GGUF", "auto", "auto", CPU, ("int8", "fp32")),
        ("qwen2.5-coder-1.5b-instruct", "auto", "fp32", CPU, ("none", "fp32")),  # a dtype named: floats
        ("qwen2.5-coder-1.5b-instruct", "auto", "bf16", CPU, ("none", "bf16")),
        ("qwen2.5-coder-1.5b-instruct", "none", "auto", CPU, ("none", "fp32")),  # one flag from exact
        ("qwen2.5-coder-1.5b-instruct", "int4", "auto", CPU, ("int4", "fp32")),
        ("qwen2.5-coder-1.5b-instruct", "auto", "auto", CUDA, ("none", "fp32")),  # a GPU: as before
        ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "auto", "auto", CPU, ("none", "fp32")),  # float checkpoint
        (object(), "auto", "auto", CPU, ("none", "fp32")),  # a model passed in loaded
    ],
)
def test_the_precision_when_none_is_named(target, target_quant, dtype, device, expected, monkeypatch) -> None:
    """Where the Q4_K kernel does not run (tests/test_q4k_store.py: where it does, "q4k")."""
    monkeypatch.setattr(precision, "rowwise_int8_available", lambda: True)
    monkeypatch.setattr(precision, "kernels_available", lambda: False)
    monkeypatch.setattr(precision, "unavailable_reason", lambda: "a test's reason")
    chosen = choose_precision(target, target_quant, dtype, device)
    assert (chosen.target_quant, chosen.dtype) == expected
    assert (chosen.hint is not None) == (target == "Qwen/Qwen2.5-Coder-1.5B-Instruct")


@pytest.mark.parametrize("int8_runs", [True, False])
def test_a_cpu_without_the_kernels_is_told_in_one_line_which_engine_runs_and_why(
    int8_runs, monkeypatch, capsys
) -> None:
    # The fallback is the int8 engine where oneDNN's int8 rows run, else float32; never silent.
    monkeypatch.setattr(precision, "rowwise_int8_available", lambda: int8_runs)
    monkeypatch.setattr(precision, "kernels_available", lambda: False)
    monkeypatch.setattr(
        precision, "unavailable_reason", lambda: "no C++ compiler (c++) to build marspec's kernels"
    )
    precision._say.cache_clear()
    engine = "int8" if int8_runs else "none"
    assert choose_precision("qwen2.5-coder-1.5b-instruct", "auto", "auto", CPU) == Precision(engine, "fp32")
    assert choose_precision("qwen2.5-coder-1.5b-instruct", "auto", "auto", CPU).target_quant == engine
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1  # once per process, however often the choice is made
    assert "the q4k engine does not run here (no C++ compiler" in lines[0]
    assert ("the int8 engine" if int8_runs else "float32 weights") in lines[0] and "GB" in lines[0]


def test_without_an_int8_dot_product_the_kernels_still_run_the_q4k_engine(monkeypatch, capsys) -> None:
    monkeypatch.setattr(precision, "rowwise_int8_available", lambda: False)
    monkeypatch.setattr(precision, "kernels_available", lambda: True)
    chosen = choose_precision("qwen2.5-coder-1.5b-instruct", "auto", "auto", CPU)
    assert chosen == Precision("q4k", "fp32") and capsys.readouterr().err == ""


def test_a_float_checkpoint_keeps_its_precision_with_a_hint_naming_the_int8_engine(tmp_path, caplog) -> None:
    from marspec.selftest.tiny import save_tiny_model, tiny_model

    folder = save_tiny_model(tmp_path / "tiny", tiny_model(seed=0))
    with caplog.at_level(logging.WARNING, logger="marspec"):
        decoder = Decoder(str(folder), "ngram", device="cpu")
    assert decoder.target_quant == "none" and decoder.target_weights == "fp32"
    hints = [r.getMessage() for r in caplog.records if "target_quant='int8'" in r.getMessage()]
    assert len(hints) == 1 and "\n" not in hints[0] and "float32" in hints[0]


def test_an_unknown_precision_is_refused_naming_the_choices() -> None:
    refusal = "unknown target_quant 'int3': choose one of auto, none, int8, q4k, int4"
    with pytest.raises(MarspecError, match=refusal):
        Decoder("smollm2-135m-instruct", None, target_quant="int3", device="cpu")


@needs_int8
def test_a_known_model_with_no_precision_named_decodes_on_the_int8_engine_exactly(known: str) -> None:
    """strict == plain, MARS(theta=1) == strict and greedy block verification == plain on the default
    engine; the draft is the same model in 4 bits (the default draft weights: the Q4_K kernel's where
    it runs, else torch's)."""
    decoder = Decoder(known, known, device="cpu")
    engine = "q4k" if kernels_available() else "int8"  # the tiny llama has no Q4_K layers: int8 either way
    assert decoder.target_quant == engine and decoder.target_weights == engine
    assert decoder.draft_weights == ("q4k" if kernels_available() else "int4")
    assert not (resolve_model_dir(known) / WEIGHTS_FILE).exists()
    prompt = "hello world, hello"
    plain = decoder.generate(prompt, rule="plain", max_new_tokens=24, chat=False)
    for opts in ({"rule": "strict"}, {"rule": "mars", "theta": 1.0}, {"rule": "block"}):
        run = decoder.generate(prompt, k=4, max_new_tokens=24, chat=False, **opts)
        assert run.token_ids == plain.token_ids, opts


def test_the_demo_names_the_weights_each_model_runs_with(tmp_path: Path) -> None:
    from marspec.selftest.tiny import save_tiny_model, tiny_model

    folder = str(save_tiny_model(tmp_path / "tiny", tiny_model(seed=0)))
    assert Decoder(folder, "ngram", device="cpu", dtype="bf16").target_weights == "bf16"
    decoder = Decoder(folder, folder, device="cpu", draft_quant="none")
    assert (decoder.target_weights, decoder.draft_weights) == ("fp32", "fp32")
    assert Decoder(folder, None, device="cpu").draft_weights is None
    assert isinstance(decoder.target, HFCausalLM)
