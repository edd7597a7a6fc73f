"""Gemma 3 on real weights: the packaged Gemma-3-270M on the default CPU engine (q4k: its sliding-window
layers, scaled embedding and norms in the direct forward), n-gram drafting, strict == plain and MARS at
theta 1 == strict."""

from __future__ import annotations

import pytest
import torch

from marspec.api import Decoder
from marspec.backends.kernels import kernels_available
from marspec.models.registry import MODELS, missing_requirements

pytestmark = [
    pytest.mark.real,
    pytest.mark.skipif(not kernels_available(), reason="the Q4_K kernel does not run here"),
    pytest.mark.skipif(
        bool(missing_requirements(MODELS["gemma-3-270m"])), reason="gemma-3-270m's package is not installed"
    ),
]


def test_gemma_3_270m_decodes_exactly_with_ngram_drafts_on_the_default_engine() -> None:
    decoder = Decoder("gemma-3-270m", "ngram", device="cpu")
    assert decoder.target_quant == "q4k" and decoder.target.direct is not None
    # Longer than its 512-position window, so its local layers slide.
    prompt = "The river runs to the sea. " * 80 + "The river"
    assert len(decoder.tokenizer(prompt).input_ids) > 512
    plain = decoder.generate(prompt, rule="plain", max_new_tokens=48, chat=False)
    strict = decoder.generate(prompt, rule="strict", k=6, max_new_tokens=48, chat=False)
    mars = decoder.generate(prompt, rule="mars", theta=1.0, k=6, max_new_tokens=48, chat=False)
    assert strict.token_ids == plain.token_ids and mars.token_ids == strict.token_ids
    assert strict.stats.drafted > 0
    # Its windows are transformers': the float model's greedy choices (transformers' forward, its
    # sliding masks) at nearly every position of the prompt (the q4k model rounds activations to int8).
    ids = torch.tensor(decoder.tokenizer(prompt).input_ids)
    q4k = decoder.target.forward(ids)
    decoder.target.reset()
    float_lm = Decoder("gemma-3-270m", None, device="cpu", target_quant="none").target
    assert float_lm.direct is None
    expected = float_lm.forward(ids)
    assert (q4k.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.95
