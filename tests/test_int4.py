"""4-bit weights (``target_quant="int4"``, ``draft_quant="int4"``): a row's result does not depend on the
rest of its forward, so strict verification of a 4-bit target still equals plain decoding of it."""

from __future__ import annotations

import pytest
import torch
from conftest import SMALL, assert_chain_rows_scored_as_one_token_forwards, tiny_lm
from test_decode import reference_greedy, run
from test_tree import TREE
from typer.testing import CliRunner

from marspec import Decoder
from marspec.backends.hf import HFCausalLM
from marspec.backends.int4 import GROUP_SIZE, Int4Linear, int4_available, quantize_int4
from marspec.backends.int8 import Int8Embedding
from marspec.backends.packed import rows_alone
from marspec.backends.quantize import quantize_draft, quantize_target
from marspec.cli import app
from marspec.drafters import ModelDrafter
from marspec.errors import MarspecError
from marspec.rules import Rule

pytestmark = pytest.mark.skipif(not int4_available(), reason="this torch build has no int4 CPU kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "bias"), [(40, True), (97, False)])  # 97: padded to 112 rows
def test_a_row_gives_the_same_bits_whatever_else_is_in_its_forward(dtype, out_features, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, out_features, bias=bias)
    layer = Int4Linear.of(linear.to(dtype))
    # Rows of very different sizes, and more rows than one of the kernel's four-row tiles.
    x = (torch.randn(13, 96) * torch.logspace(-2, 2, 13)[:, None]).to(dtype)  # [13, 96]
    with torch.no_grad():
        together = layer(x)  # [13, out]
        assert together.dtype == dtype and together.shape == (13, out_features)
        for i in range(13):
            assert torch.equal(together[i : i + 1], layer(x[i : i + 1]))
        # And any split of the rows into forwards gives the same rows.
        assert torch.equal(torch.cat([layer(x[:5]), layer(x[5:])]), together)
        exact = linear(x).float()
    # Still the layer it replaced, to 4-bit precision (random weights: ~8% per row; real ones do better).
    error = (together.float() - exact).norm(dim=1) / exact.norm(dim=1)  # [13]
    assert float(error.max()) < 0.15


def test_a_layer_whose_inputs_are_not_whole_groups_is_padded_not_refused():
    torch.manual_seed(0)
    linear = torch.nn.Linear(GROUP_SIZE + 8, 16)
    layer = Int4Linear.of(linear)
    x = torch.randn(3, GROUP_SIZE + 8)
    with torch.no_grad():
        error = (layer(x) - linear(x)).norm() / linear(x).norm()
    assert float(error) < 0.15
    assert layer(torch.randn(2, 4, GROUP_SIZE + 8)).shape == (2, 4, 16)


def test_the_weights_take_about_a_sixth_of_fp32():
    lm = tiny_lm(0, layers=2)
    linear_bytes = sum(m.weight.numel() * 4 for m in lm.model.modules() if type(m) is torch.nn.Linear)
    quantize_int4(lm.model)
    packed = [m for m in lm.model.modules() if isinstance(m, Int4Linear)]
    assert packed and not any(type(m) is torch.nn.Linear for m in lm.model.modules())
    int4_bytes = sum(m.packed_weight.nbytes + m.scale_and_zeros.nbytes for m in packed)
    # 4 bits a weight plus a bf16 scale and zero a group of 32 (1 bit a weight), and the padded LM head.
    assert int4_bytes < linear_bytes * 0.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_of_a_chain_forward_is_scored_exactly_as_a_one_token_forward(prompt, dtype):
    lm = tiny_lm(0, "int4-target", layers=3)
    quantize_target(lm.model.to(dtype), "int4")
    assert_chain_rows_scored_as_one_token_forwards(lm, prompt)


def test_an_int4_target_keeps_strict_equal_to_plain(prompt):
    target = tiny_lm(0, "int4-target", layers=3)
    quantize_target(target.model, "int4")
    assert target.reuses_prefix
    draft = tiny_lm(1, "draft")
    for rule in (Rule("strict"), Rule("mars", theta=1.0, margin="prob_ratio")):
        spec, _, stats = run(
            target, ModelDrafter(draft, target.vocab_size), prompt, rule=rule, k=4, max_new_tokens=40
        )
        assert stats.drafted > 0
        assert spec == reference_greedy(target, prompt, 40)


def test_each_node_of_a_tree_forward_is_scored_exactly_as_plain_decoding_along_its_path(prompt):
    lm = tiny_lm(0, "int4-target", layers=3)
    quantize_target(lm.model, "int4")
    lm.forward(prompt[:-1])
    base = lm.cached_len
    rows = lm.forward_tree(TREE, prompt[-1:])  # [4, V]: root, then nodes 1-3
    for node, path in {0: [], 1: [3], 2: [3, 5], 3: [4]}.items():
        lm.rollback(base)
        for token in [prompt[-1:], *(torch.tensor([t]) for t in path)]:
            one_token = lm.forward(token)[-1]  # [V]
        assert torch.equal(rows[node], one_token), node


def test_an_int4_draft_only_proposes(prompt):
    """A 4-bit draft changes acceptance, never the output: strict still equals the fp32 target's plain."""
    target = tiny_lm(0, "target")
    draft = tiny_lm(0, "int4-draft")  # the target's own weights, in 4 bits: it proposes well
    quantize_draft(draft.model, "int4")
    assert isinstance(draft.model.get_input_embeddings(), Int8Embedding)
    spec, _, stats = run(
        target, ModelDrafter(draft, target.vocab_size), prompt, rule=Rule("strict"), k=4, max_new_tokens=30
    )
    assert stats.accepted_exact > 0
    assert spec == reference_greedy(target, prompt, 30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int4_drafts_rows_are_computed_alone_with_its_int8_embedding(prompt, dtype):
    """A 4-bit draft's embedding is int8 (a quarter of float32's bytes) and looks up each row alone, so
    sequences decoded together may still pack its steps (marspec.backends.packed)."""
    lm = tiny_lm(0, "int4-draft", layers=2)
    weight = lm.model.get_input_embeddings().weight.detach().to(dtype).clone()
    quantize_draft(lm.model.to(dtype), "int4")
    embedding = lm.model.get_input_embeddings()
    assert isinstance(embedding, Int8Embedding) and embedding.lookup_dtype == dtype
    looked_up = embedding(prompt)
    assert looked_up.dtype == dtype
    # Within half an int8 step of the weight, plus the lookup dtype's own rounding.
    tolerance = float(embedding.weight_scale[prompt].amax()) / 2 + float(weight.float().abs().max()) / 128
    assert float((looked_up.float() - weight[prompt].float()).abs().max()) <= tolerance
    assert isinstance(lm.model.get_output_embeddings(), Int4Linear)  # the head as it was
    assert rows_alone(lm)
    assert_chain_rows_scored_as_one_token_forwards(lm, prompt)


def test_a_sliding_window_model_attends_each_rows_window_in_4_bits():
    """Each row attends its own window (:mod:`marspec.backends.row_attention`), so a 4-bit target with
    sliding-window layers still scores a chain's rows as one-token forwards, and is never packed."""
    model = tiny_lm(0, use_sliding_window=True, sliding_window=4, max_window_layers=0).model
    quantize_target(model, "int4")
    lm = HFCausalLM(model, None, "windowed-int4")
    assert not rows_alone(lm)
    assert_chain_rows_scored_as_one_token_forwards(lm, torch.tensor([5, 17, 42, 8, 63, 5, 17, 42, 8, 11, 3]))


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"target_quant": "int4", "dtype": "fp16"}, "fp32 or bf16 target"),
        ({"draft_quant": "int3"}, "unknown draft_quant.*int4"),
    ],
)
def test_a_bad_int4_setting_is_refused_before_loading(options, needle):
    with pytest.raises(MarspecError, match=needle):
        Decoder("no-such-model-is-ever-loaded", "no-such-draft", **options)


def test_a_loaded_target_is_not_quantised_behind_the_callers_back():
    with pytest.raises(MarspecError, match="loaded by name or path"):
        Decoder(tiny_lm(0), None, target_quant="int4")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_decoder_runs_an_int4_target_and_draft_and_strict_equals_plain(dtype):
    decoder = Decoder(SMALL, SMALL, dtype=dtype, target_quant="int4", draft_quant="int4", threads=1)
    assert any(isinstance(m, Int4Linear) for m in decoder.target.model.modules())
    assert decoder.drafter is not None
    # An int4 draft keeps the target's dtype: its int8 embedding looks up vectors in it.
    embedding = decoder.drafter.draft_model.model.get_input_embeddings()
    assert isinstance(embedding, Int8Embedding) and embedding.lookup_dtype == decoder.target.model.dtype
    plain = decoder.generate("The capital of France is", rule="plain", max_new_tokens=16, chat=False)
    strict = decoder.generate("The capital of France is", rule="strict", k=4, max_new_tokens=16, chat=False)
    assert strict.token_ids == plain.token_ids


def test_the_cli_takes_int4():
    args = [
        "generate",
        "The capital of France is",
        "--target",
        SMALL,
        "--draft",
        SMALL,
        "--max-new-tokens",
        "4",
    ]
    result = CliRunner().invoke(app, [*args, "--target-quant", "int4", "--draft-quant", "int4"])
    assert result.exit_code == 0, result.output
