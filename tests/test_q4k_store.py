"""The "q4k" CPU engine (:mod:`marspec.models.int8_store`'s second form): a GGUF's Q4_K and Q6_K layers
keep their blocks for the kernels (no second rounding), its other layers become int8 rows run by the same
kernel (:class:`~marspec.backends.int8_planes.Int8PlanesLinear`), and the model
so built decodes exactly (strict == plain, MARS at theta 1 == strict, block == plain) as the default on a
CPU that runs the kernels. The GGUF is a tiny Qwen2 written here with Q4_K, Q6_K and float tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_gguf_int4 import register_known
from test_models import _byte_chars
from test_q6k import random_blocks as random_q6k_blocks

from marspec import precision
from marspec.api import Decoder
from marspec.backends.int8 import Int8Embedding, RowwiseInt8Linear, int8_rows
from marspec.backends.int8_planes import Int8PlanesLinear
from marspec.backends.kernels import kernels_available
from marspec.backends.q4k import Q4KLinear, dequantize_q4k, q4k_blocks, quantised_rows_product
from marspec.backends.q6k import Q6KLinear, dequantize_q6k
from marspec.models.cache import WEIGHTS_FILE
from marspec.models.convert import resolve_model_dir
from marspec.models.int8_store import int8_model_file
from marspec.precision import choose_precision

needs_kernel = pytest.mark.skipif(not kernels_available(), reason="the Q4_K kernel does not run here")
HIDDEN, FFN, HEADS, KV_HEADS = 256, 512, 4, 2
HEAD_DIM = HIDDEN // HEADS
# Written as Q4_K or Q6_K (rows of 256-weight super-blocks), as in a real Q4_K_M file; the rest stay
# float32 in the GGUF.
Q4K_TENSORS = ("token_embd", "blk.0.attn_q", "blk.0.attn_output", "blk.0.ffn_gate", "blk.0.ffn_up")
Q6K_TENSORS = ("blk.0.attn_v", "blk.0.ffn_down")


def write_tiny_qwen2_gguf(path: Path, seed: int = 0) -> tuple[Path, dict[str, np.ndarray]]:
    """A 1-layer Qwen2 GGUF (hidden 256, tied embedding) with :data:`Q4K_TENSORS` in Q4_K and
    :data:`Q6K_TENSORS` in Q6_K; returns it and what was written, by GGUF name (raw blocks, or the float32
    values of the other weights)."""
    import gguf

    tokens = [*_byte_chars(), "he", "ll", "hell", "or", "<s>", "</s>"]
    vocab = len(tokens)
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_name("tiny test qwen2")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (vocab - 2) + [gguf.TokenType.CONTROL] * 2)
    writer.add_token_merges(["h e", "l l", "he ll", "o r"])
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)
    writer.add_add_bos_token(False)
    rng = np.random.default_rng(seed)
    raw: dict[str, np.ndarray] = {}

    def weight(name: str, rows: int, cols: int) -> None:
        values = (rng.standard_normal((rows, cols)) * 0.3).astype(np.float32)
        if name in Q4K_TENSORS or name in Q6K_TENSORS:
            q4k = name in Q4K_TENSORS
            raw[name] = (
                q4k_blocks(torch.from_numpy(values)) if q4k else random_q6k_blocks(rows, cols, seed=len(raw))
            )
            writer.add_tensor(
                f"{name}.weight",
                raw[name],
                raw_shape=raw[name].shape,
                raw_dtype=gguf.GGMLQuantizationType.Q4_K if q4k else gguf.GGMLQuantizationType.Q6_K,
            )
        else:
            raw[name] = values
            writer.add_tensor(f"{name}.weight", values)

    weight("token_embd", vocab, HIDDEN)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(HIDDEN, np.float32))
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(HIDDEN, np.float32))
    weight("blk.0.attn_q", HEADS * HEAD_DIM, HIDDEN)
    weight("blk.0.attn_k", KV_HEADS * HEAD_DIM, HIDDEN)
    weight("blk.0.attn_v", KV_HEADS * HEAD_DIM, HIDDEN)
    for name, size in (
        ("attn_q", HEADS * HEAD_DIM),
        ("attn_k", KV_HEADS * HEAD_DIM),
        ("attn_v", KV_HEADS * HEAD_DIM),
    ):
        writer.add_tensor(f"blk.0.{name}.bias", (rng.standard_normal(size) * 0.1).astype(np.float32))
    weight("blk.0.attn_output", HIDDEN, HEADS * HEAD_DIM)
    weight("blk.0.ffn_gate", FFN, HIDDEN)
    weight("blk.0.ffn_up", FFN, HIDDEN)
    weight("blk.0.ffn_down", HIDDEN, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, raw


@pytest.fixture
def tiny_qwen2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, np.ndarray]]:
    """A known model whose GGUF is the tiny Qwen2, in a cache of the test's own."""
    monkeypatch.setenv("MARSPEC_CACHE_DIR", str(tmp_path / "cache"))
    path, raw = write_tiny_qwen2_gguf(tmp_path / "source.gguf")
    return register_known(monkeypatch, path), raw


@needs_kernel
def test_q4k_and_q6k_layers_keep_the_ggufs_blocks_and_the_others_are_int8(tiny_qwen2) -> None:
    known, raw = tiny_qwen2
    decoder = Decoder(known, None, target_quant="q4k", device="cpu")
    model = decoder.target.model
    layer = model.model.layers[0]
    for module in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj):
        assert isinstance(module, Q4KLinear)
    assert isinstance(layer.self_attn.v_proj, Q6KLinear) and isinstance(layer.mlp.down_proj, Q6KLinear)
    assert isinstance(layer.self_attn.k_proj, Int8PlanesLinear)  # float in the GGUF: int8 rows
    assert isinstance(model.lm_head, Q4KLinear)  # tied: the embedding's own Q4_K blocks
    assert isinstance(model.get_input_embeddings(), Int8Embedding)
    folder = resolve_model_dir(known)
    assert int8_model_file(folder, "q4k").is_file() and not (folder / WEIGHTS_FILE).exists()
    # The layer computes with the GGUF's weights themselves: against the dequantized blocks in float, it
    # differs by the activations' int8 rounding only.
    x = torch.randn(5, HIDDEN)
    exact = x @ dequantize_q4k(raw["blk.0.ffn_gate"]).T
    assert torch.allclose(layer.mlp.gate_proj(x), exact, rtol=0.0, atol=0.02 * exact.abs().max().item())
    x = torch.randn(5, FFN)
    exact = x @ dequantize_q6k(raw["blk.0.ffn_down"]).T
    assert torch.allclose(layer.mlp.down_proj(x), exact, rtol=0.0, atol=0.02 * exact.abs().max().item())
    # The float layer is the int8 rows int8_rows makes of the file's weights, their product exact.
    int8, scale = int8_rows(torch.from_numpy(raw["blk.0.attn_k"]))
    x = torch.randn(5, HIDDEN)
    rows = quantised_rows_product(x, int8.double() * scale.double()[:, None], layer.self_attn.k_proj.bias)
    keys = layer.self_attn.k_proj(x).double()
    assert torch.allclose(keys, rows, rtol=0.0, atol=1e-5 * rows.abs().max().item())


@needs_kernel
def test_the_q4k_model_loads_back_from_its_file_the_same(tiny_qwen2) -> None:
    known, _ = tiny_qwen2
    ids = torch.tensor([[5, 70, 200, 3, 99, 261]])
    with torch.no_grad():
        first = Decoder(known, None, target_quant="q4k", device="cpu").target.model(ids).logits
        again = Decoder(known, None, target_quant="q4k", device="cpu").target.model(ids).logits
    assert torch.equal(first, again)


@needs_kernel
def test_a_gguf_with_q4k_layers_decodes_exactly_on_the_default_engine(tiny_qwen2) -> None:
    """No precision named: the q4k engine; strict == plain, MARS(theta=1) == strict, block == plain."""
    known, _ = tiny_qwen2
    decoder = Decoder(known, "ngram", device="cpu")
    assert decoder.target_quant == "q4k" and decoder.target_weights == "q4k"
    prompt = "hello world, hello hello world"
    plain = decoder.generate(prompt, rule="plain", max_new_tokens=32, chat=False)
    for opts in ({"rule": "strict"}, {"rule": "mars", "theta": 1.0}, {"rule": "block"}):
        run = decoder.generate(prompt, k=6, max_new_tokens=32, chat=False, **opts)
        assert run.token_ids == plain.token_ids, opts
    assert decoder.generate(prompt, rule="strict", k=6, max_new_tokens=32, chat=False).stats.drafted > 0


def test_the_default_for_a_gguf_is_q4k_where_the_kernel_runs_else_int8(monkeypatch) -> None:
    monkeypatch.setattr(precision, "rowwise_int8_available", lambda: True)
    cpu = torch.device("cpu")
    for runs, expected in ((True, "q4k"), (False, "int8")):
        monkeypatch.setattr(precision, "kernels_available", lambda runs=runs: runs)
        assert choose_precision("qwen2.5-coder-1.5b-instruct", "auto", "auto", cpu).target_quant == expected
        assert (
            choose_precision("Qwen/Qwen2.5-Coder-1.5B-Instruct", "auto", "auto", cpu).target_quant == "none"
        )


@needs_kernel
def test_a_q4k_draft_runs_every_layer_on_the_kernel_and_leaves_strict_equal_to_plain(tiny_qwen2) -> None:
    """The draft's form quantises the GGUF's other layers (Q6_K, float) to Q4_K too (widths of any size,
    padded)."""
    known, _ = tiny_qwen2
    decoder = Decoder(known, known, target_quant="int8", device="cpu")
    assert decoder.draft_weights == "q4k"
    draft = decoder.drafter.draft_model.model
    assert not any(isinstance(m, (RowwiseInt8Linear, Q6KLinear, torch.nn.Linear)) for m in draft.modules())
    assert int8_model_file(resolve_model_dir(known), "q4k-draft").is_file()
    prompt = "hello world, hello hello world"
    plain = decoder.generate(prompt, rule="plain", max_new_tokens=24, chat=False)
    strict = decoder.generate(prompt, rule="strict", k=5, max_new_tokens=24, chat=False)
    assert strict.token_ids == plain.token_ids and strict.stats.drafted > 0


@needs_kernel
def test_a_layer_of_any_width_pads_its_rows_and_computes_each_row_alone() -> None:
    linear = torch.nn.Linear(300, 40)
    layer = Q4KLinear.of(linear)
    assert layer.in_features == 300 and Q4KLinear(**layer.tensors).in_features == 300
    x = torch.randn(7, 300)
    together = layer(x)
    assert all(torch.equal(together[i], layer(x[i : i + 1])[0]) for i in range(7))
    assert torch.allclose(together, linear(x), atol=0.1 * linear(x).abs().max().item())
