"""oneDNN-prepacked linear layers: the same products as nn.Linear, on every layer, and only where asked."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_lm

from marspec import Decoder, MarspecError
from marspec.backends.prepack import PrepackedLinear, prepack_available, prepack_linears
from marspec.backends.quantize import quantize_int8
from marspec.decode import DecodeConfig, decode
from marspec.drafters import ModelDrafter
from marspec.rules import Rule
from marspec.stats import GenerationStats

pytestmark = pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (1, 17, 64)])
def test_prepacked_linear_computes_the_linear_layer(bias, shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        want = linear(x)
        got = PrepackedLinear(linear)(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _linears(model: torch.nn.Module) -> int:
    return sum(type(m) is torch.nn.Linear for m in model.modules())


def test_every_linear_layer_is_replaced_and_the_logits_stay():
    lm = tiny_lm(0)
    ids = torch.tensor([[5, 17, 42, 8, 63, 5, 17, 42]])
    with torch.inference_mode():
        want = lm.model(input_ids=ids).logits
    n_linear = _linears(lm.model)
    assert prepack_linears(lm.model) == n_linear > 0
    assert _linears(lm.model) == 0
    assert prepack_linears(lm.model) == 0  # already packed: nothing left to do
    with torch.inference_mode():
        got = lm.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_decode_loop_runs_on_a_prepacked_model(prompt):
    """Multi-token verification and cache rollback go through the packed layers too."""
    plain_lm, packed_lm, packed_draft = tiny_lm(0), tiny_lm(0), tiny_lm(0)
    prepack_linears(packed_lm.model)
    prepack_linears(packed_draft.model)
    results = []
    for target, drafter in ((plain_lm, None), (packed_lm, ModelDrafter(packed_draft, packed_lm.vocab_size))):
        stats, tokens = GenerationStats(), []
        config = DecodeConfig(rule=Rule("strict"), k=4, max_new_tokens=24)
        for step in decode(target, drafter, prompt, config, stats, torch.Generator().manual_seed(0)):
            tokens += step.tokens
        results.append((tokens, stats))
    (plain_tokens, _), (spec_tokens, spec_stats) = results
    assert spec_tokens == plain_tokens
    # A draft with the target's own weights is always right: every step verified 5 tokens at once.
    assert spec_stats.target_forwards < 24 // 2


def test_int8_quantised_layers_are_left_alone():
    lm = tiny_lm(0)
    quantize_int8(lm.model)
    assert prepack_linears(lm.model) == 0


def test_a_half_precision_linear_is_refused_with_the_fix():
    lm = tiny_lm(0)
    lm.model.half()
    with pytest.raises(MarspecError, match="fp32 or bf16"):
        prepack_linears(lm.model)


def test_decoder_prepacks_models_it_loads_but_not_models_passed_in():
    small = "smollm2-135m-instruct"
    # Prepacking is of float models: the float target, not the int8 engine a known model gets by default.
    assert _linears(Decoder(small, None, target_quant="none").target.model) == 0
    assert _linears(Decoder(small, None, target_quant="none", prepack=False).target.model) > 0
    given = tiny_lm(0)
    Decoder(given, None)
    assert _linears(given.model) > 0
    with pytest.raises(MarspecError, match="prepack must be true or false"):
        Decoder(small, None, prepack="yes")
