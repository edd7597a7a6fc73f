"""A prompt longer than one forward's chunk (:attr:`marspec.backends.hf.HFCausalLM.prefill_chunk`): on the
q4k engine every row's logits and cache entries are the same bits in chunks of any size as in one forward,
so what a generation decodes does not depend on the chunk size (a tiny random Qwen2.5-shaped GGUF)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from marspec.api import Decoder
from marspec.backends.kernels import kernels_available
from marspec.models.shapes import byte_tokenizer, write_shape_gguf

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the Q4_K kernel does not run here")
PROMPT_TOKENS = 40
CHUNKS = (1, 7, 16, PROMPT_TOKENS - 1)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Decoder:
    root = tmp_path_factory.mktemp("long-prompts")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MARSPEC_CACHE_DIR", str(root / "cache"))
        path = write_shape_gguf("qwen2.5-tiny", root / "qwen2.5-tiny.gguf", byte_tokenizer(), seed=5)
        return Decoder(str(path), "ngram", device="cpu")


def _cache(lm) -> list[torch.Tensor]:
    return [
        torch.cat((layer.keys, layer.values))[..., : lm.cached_len, :].clone() for layer in lm.cache_layers
    ]


def _scored(lm, ids: torch.Tensor, chunk: int | None, last_only: bool = False) -> torch.Tensor:
    lm.prefill_chunk = chunk
    lm.reset()
    return lm.forward(ids, last_only=last_only)


def test_every_chunk_size_gives_the_rows_and_cache_of_one_forward(decoder: Decoder, monkeypatch) -> None:
    lm = decoder.target
    assert decoder.target_quant == "q4k" and lm.chunks_exactly()
    ids = torch.randint(3, lm.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(1))
    whole = _scored(lm, ids, None)
    whole_cache = _cache(lm)
    forwards = []
    once = lm._forward_once
    monkeypatch.setattr(
        lm, "_forward_once", lambda tokens, last: forwards.append(len(tokens)) or once(tokens, last)
    )
    for chunk in CHUNKS:
        forwards.clear()
        assert torch.equal(_scored(lm, ids, chunk), whole), f"chunks of {chunk}"
        assert forwards == [min(chunk, PROMPT_TOKENS - s) for s in range(0, PROMPT_TOKENS, chunk)]
        assert all(torch.equal(a, b) for a, b in zip(_cache(lm), whole_cache, strict=True))
        assert torch.equal(_scored(lm, ids, chunk, last_only=True), whole[-1:])
    lm.prefill_chunk = None


def test_a_generation_after_a_long_prompt_does_not_depend_on_the_chunk_size(decoder: Decoder) -> None:
    lm = decoder.target
    prompt = "the river runs to the sea, and the sea runs to the river; " * 3
    assert len(decoder.tokenizer(prompt).input_ids) > 4 * 16
    outputs = {}
    try:
        for chunk in (None, 16):
            lm.prefill_chunk = chunk
            plain = decoder.generate(prompt, rule="plain", max_new_tokens=24, chat=False)
            strict = decoder.generate(prompt, rule="strict", k=5, max_new_tokens=24, chat=False)
            assert strict.token_ids == plain.token_ids and strict.stats.drafted > 0
            outputs[chunk] = plain.token_ids
    finally:
        lm.prefill_chunk = None
    assert outputs[16] == outputs[None]


def test_a_model_whose_rows_meet_is_scored_in_one_forward(tmp_path: Path) -> None:
    from test_direct import row_attention_model

    from marspec.backends.hf import HFCausalLM

    model = row_attention_model("llama")
    model.set_attn_implementation("sdpa")  # a many-row kernel: a chunk would round differently
    lm = HFCausalLM(model, None, "float")  # type: ignore[arg-type]
    lm.prefill_chunk = 4
    assert not lm.chunks_exactly()
    ids = torch.arange(3, 3 + 10)
    seen = []
    once = lm._forward_once
    lm._forward_once = lambda tokens, last: seen.append(len(tokens)) or once(tokens, last)  # type: ignore[method-assign]
    lm.forward(ids)
    assert seen == [10]
