"""Today's model families on the q4k engine, from a GGUF: Qwen3, Llama 3.x (rope scaling), Qwen2.5,
Mistral, Phi-3 (fused layers) and Gemma 3 (sliding window, scaled embedding, its norms). Each is a tiny
random model of the family's shape (:mod:`marspec.models.shapes`); on each, the default engine runs the
direct forward, strict == plain and MARS at theta 1 == strict bit for bit, and the direct forward over
marspec's float conversion gives transformers' own forward's logits for transformers' own load of the
same file (so a family is not silently wrong)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from marspec.api import Decoder
from marspec.backends.hf import HFCausalLM
from marspec.backends.kernels import kernels_available
from marspec.backends.row_attention import use_row_attention
from marspec.models.loading import load_model
from marspec.models.shapes import SHAPES, byte_tokenizer, sentencepiece_tokenizer, write_shape_gguf

needs_kernel = pytest.mark.skipif(not kernels_available(), reason="the Q4_K kernel does not run here")
FAMILIES = ("qwen3-tiny", "llama-3.1-tiny", "qwen2.5-tiny", "mistral-tiny", "phi3-tiny", "gemma3-tiny")
PROMPT = "hello world, hello hello world, the world"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Each family's tiny GGUF (Gemma's with a SentencePiece tokenizer, as its converter wants), in a
    marspec cache of the module's own."""
    root = tmp_path_factory.mktemp("families")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MARSPEC_CACHE_DIR", str(root / "cache"))
        yield {
            name: write_shape_gguf(
                name,
                root / f"{name}.gguf",
                sentencepiece_tokenizer() if name.startswith("gemma") else byte_tokenizer(),
                seed=3,
            )
            for name in FAMILIES
        }


@pytest.fixture(scope="module")
def decoders(ggufs) -> dict[str, Decoder]:
    """Each family's Decoder with n-gram drafts and no precision named, made once when first asked."""

    class Made(dict):
        def __missing__(self, family: str) -> Decoder:
            self[family] = Decoder(str(ggufs[family]), "ngram", device="cpu")
            return self[family]

    return Made()


@needs_kernel
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_runs_the_direct_forward_on_the_q4k_engine_exactly(family: str, decoders) -> None:
    decoder = decoders[family]
    assert decoder.target_quant == "q4k" and decoder.target.direct is not None
    plain = decoder.generate(PROMPT, rule="plain", max_new_tokens=16, chat=False)
    strict = decoder.generate(PROMPT, rule="strict", k=5, max_new_tokens=16, chat=False)
    mars = decoder.generate(PROMPT, rule="mars", theta=1.0, k=5, max_new_tokens=16, chat=False)
    assert strict.token_ids == plain.token_ids and mars.token_ids == strict.token_ids
    assert strict.stats.drafted > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_direct_forward_gives_transformers_logits(family: str, ggufs, decoders) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = ggufs[family]
    model, tokenizer, _ = load_model(str(path))  # marspec's conversion, float32
    use_row_attention(model)
    lm = HFCausalLM(model, tokenizer, family)
    assert lm.direct is not None
    ids = torch.tensor(tokenizer(PROMPT).input_ids)
    assert len(ids) > (SHAPES[family].sliding_window or 0)  # Gemma's window slides
    ours = lm.forward(ids)
    # transformers' own load of the file; the configuration marspec completed (transformers reads no
    # Llama 3 rope scaling, nor Qwen3's head width from a GGUF).
    config = AutoConfig.from_pretrained(_folder(path), local_files_only=True)
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=config, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        theirs = reference(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item())
    # The default engine's model computes with the file's own blocks (a Llama's q and k rows put back
    # in order on them): within its int8 activations' rounding of the float model (~2% here), where a
    # row out of order would be ~100% off.
    target = decoders[family].target
    target.reset()
    q4k = target.forward(ids)
    target.reset()
    assert (q4k - ours).abs().max() < 0.1 * ours.abs().max()
    assert (q4k.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.8


def _folder(path: Path) -> Path:
    from marspec.models.convert import resolve_model_dir

    return resolve_model_dir(str(path))


def test_the_llama_3_rope_scaling_and_a_head_width_are_read_from_the_gguf(ggufs) -> None:
    from transformers import AutoConfig

    llama = AutoConfig.from_pretrained(_folder(ggufs["llama-3.1-tiny"]), local_files_only=True)
    assert llama.rope_parameters["rope_type"] == "llama3" and llama.rope_parameters["factor"] == 8.0
    qwen3 = AutoConfig.from_pretrained(_folder(ggufs["qwen3-tiny"]), local_files_only=True)
    assert qwen3.head_dim == SHAPES["qwen3-tiny"].head_dim  # not Qwen3Config's default 128


def test_a_family_the_direct_forward_does_not_take_is_named_in_one_line() -> None:
    from test_direct import row_attention_model

    from marspec.backends.direct import fallback_note

    model = row_attention_model("llama")
    assert fallback_note(model, "mine", "q4k") is None
    model.config.model_type = "olmo"
    note = fallback_note(model, "mine", "q4k")
    assert note is not None and "\n" not in note and "mine (olmo)" in note and "transformers' forward" in note
