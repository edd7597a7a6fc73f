"""An int8 target (``target_quant="int8"``): each token row is quantised on its own, so a row's output
does not depend on the rest of its forward and strict verification still equals plain decoding."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SMALL, assert_chain_rows_scored_as_one_token_forwards, tiny_lm
from test_decode import reference_greedy, run
from test_tree import TREE
from typer.testing import CliRunner

from marspec import Decoder
from marspec.backends.hf import HFCausalLM
from marspec.backends.quantize import RowwiseInt8Linear, quantize_target_int8, rowwise_int8_available
from marspec.backends.row_attention import row_by_row_attention, use_row_attention
from marspec.cli import app
from marspec.drafters import ModelDrafter
from marspec.errors import MarspecError
from marspec.rules import Rule
from marspec.settings import GenerationOptions

needs_onednn_int8 = pytest.mark.skipif(
    not rowwise_int8_available(), reason="this torch build or CPU has no oneDNN int8 kernels"
)


@needs_onednn_int8
@pytest.mark.parametrize("bias", [True, False])
def test_a_row_gives_the_same_bits_whatever_else_is_in_its_forward(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=bias)
    layer = RowwiseInt8Linear.of(linear)
    # Rows of very different sizes: a scale shared by the forward would change the small rows' results.
    x = torch.randn(13, 96) * torch.logspace(-2, 2, 13)[:, None]  # [13, 96]
    with torch.no_grad():
        together = layer(x)  # [13, 40]
        for i in range(13):
            assert torch.equal(together[i : i + 1], layer(x[i : i + 1]))
        # And it is still the layer it replaced, to int8 precision.
        exact = linear(x)
    error = (together - exact).norm(dim=1) / exact.norm(dim=1)  # [13]
    assert float(error.max()) < 0.03


@needs_onednn_int8
def test_leading_dimensions_are_kept():
    layer = RowwiseInt8Linear.of(torch.nn.Linear(32, 8))
    assert layer(torch.randn(2, 5, 32)).shape == (2, 5, 8)


@needs_onednn_int8
def test_an_int8_target_keeps_strict_equal_to_plain(prompt):
    target = tiny_lm(0, "int8-target", layers=3)
    quantize_target_int8(target.model)
    assert not any(type(m) is torch.nn.Linear for m in target.model.modules())
    assert target.reuses_prefix  # a row's keys and values do not depend on how the prompt was chunked
    draft = tiny_lm(1, "draft")
    spec, _, stats = run(
        target, ModelDrafter(draft, target.vocab_size), prompt, rule=Rule("strict"), k=4, max_new_tokens=40
    )
    assert stats.drafted > 0
    assert spec == reference_greedy(target, prompt, 40)


@needs_onednn_int8
def test_each_row_of_a_chain_forward_is_scored_exactly_as_a_one_token_forward(prompt):
    """The property strict == plain rests on: int8 re-quantisation turns a rounding difference into a
    quantisation step, so the rows must match bit for bit, attention included."""
    lm = tiny_lm(0, "int8-target", layers=3)
    quantize_target_int8(lm.model)
    assert_chain_rows_scored_as_one_token_forwards(lm, prompt)


@needs_onednn_int8
def test_each_node_of_a_tree_forward_is_scored_exactly_as_plain_decoding_along_its_path(prompt):
    lm = tiny_lm(0, "int8-target", layers=3)
    quantize_target_int8(lm.model)
    lm.forward(prompt[:-1])
    base = lm.cached_len
    rows = lm.forward_tree(TREE, prompt[-1:])  # [4, V]: root, then nodes 1-3
    for node, path in {0: [], 1: [3], 2: [3, 5], 3: [4]}.items():
        lm.rollback(base)
        for token in [prompt[-1:], *(torch.tensor([t]) for t in path)]:
            one_token = lm.forward(token)[-1]  # [V]
        assert torch.equal(rows[node], one_token), node


@needs_onednn_int8
def test_an_int8_target_drafts_trees_too(prompt):
    target = tiny_lm(0, "int8-target", layers=3)
    quantize_target_int8(target.model)
    drafter = ModelDrafter(tiny_lm(1, "draft"), target.vocab_size)
    spec, _, stats = run(target, drafter, prompt, rule=Rule("strict"), k=3, max_new_tokens=30, tree=(2, 2))
    assert sum(step.siblings for step in stats.steps) > 0
    assert spec == reference_greedy(target, prompt, 30)


def test_a_sliding_window_model_attends_each_rows_window_and_stays_exact():
    """Row-by-row attention windows each row itself (as transformers' sliding mask does): the float
    model's logits are transformers' SDPA forward's, and the int8 target keeps strict == plain."""
    lm = tiny_lm(0, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    prompt = torch.tensor([5, 17, 42, 8, 63, 5, 17, 42, 8, 11, 3])  # longer than the window
    with torch.no_grad():
        expected = lm.model(prompt.unsqueeze(0)).logits[0]  # transformers' SDPA, its sliding mask
    use_row_attention(lm.model)
    windowed = HFCausalLM(lm.model, None, "windowed")
    assert windowed.direct is not None
    torch.testing.assert_close(windowed.forward(prompt), expected, rtol=1e-5, atol=1e-5)
    quantize_target_int8(lm.model)
    target = HFCausalLM(lm.model, None, "windowed-int8")
    assert_chain_rows_scored_as_one_token_forwards(target, prompt)
    drafter = ModelDrafter(tiny_lm(1, "draft"), target.vocab_size)
    spec, _, _ = run(target, drafter, prompt, rule=Rule("strict"), k=3, max_new_tokens=30)
    assert spec == reference_greedy(target, prompt, 30)


def test_a_sliding_window_reaching_the_attention_attends_the_last_positions():
    query, key = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8)
    out, _ = row_by_row_attention(torch.nn.Module(), query, key, key, None, sliding_window=2)
    last_two = torch.nn.functional.scaled_dot_product_attention(query, key[:, :, -2:], key[:, :, -2:])
    torch.testing.assert_close(out, last_two.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_an_int8_target_needs_fp32():
    lm = tiny_lm(0)
    lm.model.to(torch.bfloat16)
    with pytest.raises(MarspecError, match="fp32"):
        quantize_target_int8(lm.model)


@pytest.mark.parametrize(
    ("target", "options", "needle"),
    [
        (SMALL, {"target_quant": "fp4"}, "unknown target_quant"),
        (SMALL, {"target_quant": "int8", "dtype": "bf16"}, "use dtype='fp32'"),
        ("loaded", {"target_quant": "int8"}, "loaded by name or path"),
    ],
)
def test_a_target_that_cannot_be_quantised_is_refused_before_loading(target, options, needle):
    model = tiny_lm(0) if target == "loaded" else target
    with pytest.raises(MarspecError, match=needle):
        Decoder(model, None, **options)


@needs_onednn_int8
def test_theta_auto_reads_the_int8_targets_own_calibration(tmp_path, monkeypatch):
    """The int8 target is another model: a calibration of the float target does not speak for it."""
    from marspec.calibration import Choice, save_choice

    monkeypatch.setenv("MARSPEC_CALIBRATION_DIR", str(tmp_path))
    save_choice(SMALL, "ngram", Choice("prob_ratio", 0.05, 0.99, True, "test", 0.0, {}))  # the float target's
    decoder = Decoder(SMALL, "ngram", target_quant="int8")
    with pytest.raises(MarspecError, match=r"\(int8\).*marspec calibrate .* --target-quant int8"):
        decoder.generate("Hi", rule="mars", theta="auto", max_new_tokens=2)
    save_choice(SMALL, "ngram", Choice("prob_ratio", 0.3, 0.99, True, "test", 0.0, {}), "int8")
    rule = decoder.settle(GenerationOptions(rule="mars", theta="auto")).rule
    assert (rule.margin, rule.theta) == ("prob_ratio", 0.3)


def test_the_cli_refuses_an_unknown_target_quant_in_one_line():
    result = CliRunner().invoke(app, ["generate", "hi", "--target-quant", "fp4"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error:") and "unknown target_quant" in result.output
    assert len(result.output.strip().splitlines()) == 1


@needs_onednn_int8
def test_bench_runs_an_int8_target_and_keeps_its_runs_apart(tmp_path):
    args = ["bench", "--task", "gsm8k", "--limit", "1", "--methods", "plain,strict", "--target", SMALL]
    args += ["--draft", SMALL, "--max-new-tokens", "12", "--k", "3", "--threads", "1", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, [*args, "--target-quant", "int8"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["target_quant"] == "int8"
    assert summary["methods"]["strict"]["same_as_baseline"] == 1  # strict equals plain of the int8 target
    assert f"`{SMALL}` (int8)" in (tmp_path / "summary.md").read_text()
    refused = CliRunner().invoke(app, [*args, "--target-quant", "none"])  # the same folder, fp32 target
    assert refused.exit_code == 2 and "target_quant" in refused.output
