"""The position cache (marspec.backends.kv_cache) on transformers' public cache API: what it is built from,
how transformers' own entry points drive it, that a sliding-window model keeps transformers' layers, and
an fp16 cache asked for.
(Its logits against DynamicCache's are checked bit for bit in test_backends.py; trees in test_tree.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, assert_chain_rows_scored_as_one_token_forwards, tiny_lm
from transformers import Cache, DynamicLayer, Qwen2Config

from marspec.backends import HFCausalLM
from marspec.backends.kernels import kernels_available
from marspec.backends.kv_cache import INITIAL_CAPACITY, PositionLayer, position_cache
from marspec.backends.quantize import quantize_target_q4k
from marspec.batch.views import SlotLM

KV_CACHE_SOURCE = Path(__file__).parents[1] / "src" / "marspec" / "backends" / "kv_cache.py"


def test_the_cache_imports_only_names_transformers_exports_at_its_top_level():
    """transformers' submodules (cache_utils and the like) are internals that move between releases;
    marspec supports a range of them, so the cache may use only what ``import transformers`` exports."""
    tree = ast.parse(KV_CACHE_SOURCE.read_text())
    modules = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    modules += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    from_transformers = [m for m in modules if m and m.split(".")[0] == "transformers"]
    assert from_transformers and set(from_transformers) == {"transformers"}


def test_full_attention_layers_become_position_layers_and_sliding_ones_stay():
    config = Qwen2Config(
        num_hidden_layers=3,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        use_sliding_window=True,
        sliding_window=8,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    cache = position_cache(config)
    assert isinstance(cache, Cache)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds[0] is kinds[2] is PositionLayer
    assert kinds[1] is not PositionLayer and issubclass(kinds[1], DynamicLayer)
    assert cache.is_sliding == [False, True, False]


def test_a_sliding_window_model_keeps_no_prefix_and_still_decodes_like_dynamic_cache():
    base = tiny_lm(
        0, layer_types=["full_attention", "sliding_attention"], use_sliding_window=True, sliding_window=8
    )
    ours = HFCausalLM(base.model, tokenizer=None, name="tiny")
    theirs = HFCausalLM(base.model, tokenizer=None, name="tiny", position_cache=False)
    assert not ours.reuses_prefix
    prompt = torch.randint(0, TINY_VOCAB, (20,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(ours.forward(prompt), theirs.forward(prompt))
    for token in (3, 5, 7):
        step = torch.tensor([token])
        assert torch.equal(ours.forward(step), theirs.forward(step))


def test_transformers_early_initialisation_then_appends_rollback_and_reset():
    """Cache.early_initialization (transformers' export path) sizes the buffers; appends then write at the
    length, crop cuts it, reset keeps the buffers for the next sequence."""
    cache = Cache(layers=[PositionLayer(), PositionLayer()])
    cache.early_initialization(
        batch_size=1, num_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu")
    )
    layer = cache.layers[0]
    assert layer.is_initialized and cache.get_seq_length() == 0
    buffer = layer._key_buf
    keys = torch.randn(1, 2, 5, 4)
    out_keys, out_values = cache.update(keys, -keys, 0)
    assert torch.equal(out_keys, keys) and torch.equal(out_values, -keys)
    assert cache.get_seq_length() == 5 and cache.get_mask_sizes(3, 0) == (8, 0)
    cache.crop(-2)
    assert cache.get_seq_length() == 3 and torch.equal(layer.keys, keys[:, :, :3])
    more = torch.randn(1, 2, INITIAL_CAPACITY, 4)  # past the first buffer: it doubles, the prefix is kept
    cache.update(more, more, 0)
    assert layer._key_buf.shape[-2] == 2 * INITIAL_CAPACITY
    assert torch.equal(layer.keys, torch.cat((keys[:, :, :3], more), dim=2))
    grown = layer._key_buf
    cache.reset()
    assert cache.get_seq_length() == 0 and layer._key_buf is grown and grown is not buffer
    with pytest.raises(ValueError, match="negative"):
        layer.crop(1)


def test_keys_and_values_are_views_of_the_cached_positions_and_not_written_from_outside():
    layer = PositionLayer()
    assert layer.keys is None and layer.values is None
    keys = torch.randn(1, 2, 4, 8)
    layer.update(keys, -keys)
    layer.room(keys, keys, 1)[0][:, :, 4] = 7.0  # a native writer's position, then advanced
    layer.advance(1)
    assert torch.equal(layer.keys, torch.cat((keys, torch.full((1, 2, 1, 8), 7.0)), dim=2))
    layer.crop(-3)
    assert torch.equal(layer.keys, keys[:, :, :2]) and torch.equal(layer.values, -keys[:, :, :2])
    assert layer.keys.data_ptr() == layer._key_buf.data_ptr()  # a view, not a copy
    layer.reset()
    assert layer.keys.shape == (1, 2, 0, 8)
    with pytest.raises(AttributeError, match="write them with update"):
        layer.keys = keys


def test_a_new_sequence_of_another_shape_gets_new_buffers():
    """Shapes are checked when a sequence starts (after a reset, or a rollback to nothing), not per token."""
    layer = PositionLayer()
    layer.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    layer.reset()
    keys, values = layer.update(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))  # batch 2 now
    assert keys.shape == values.shape == (2, 2, 1, 4) and layer.get_seq_length() == 1
    layer.crop(-1)
    doubles = torch.zeros(2, 2, 1, 4, dtype=torch.float64)
    keys, _ = layer.update(doubles, doubles)
    assert keys.dtype == torch.float64 and layer.get_seq_length() == 1


def test_a_layer_asked_for_fp16_rounds_what_it_writes_as_torch_rounds():
    layer = PositionLayer(torch.float16)
    keys = torch.randn(1, 2, 3, 16) * 100
    out_keys, out_values = layer.update(keys, -keys)
    assert out_keys.dtype == out_values.dtype == layer.dtype == torch.float16
    assert torch.equal(out_keys, keys.half()) and torch.equal(out_values, (-keys).half())
    layer.reset()  # the buffers fit the next sequence: kept, not remade because the states are float32
    buffer = layer._key_buf
    layer.update(keys, keys)
    assert layer._key_buf is buffer


@pytest.mark.skipif(not kernels_available(), reason="no marspec kernels here")
def test_an_fp16_cache_is_asked_for_and_keeps_a_quantised_models_rows_exact(prompt: torch.Tensor):
    """The model's dtype by default; fp16 when asked for (from the next sequence on), where each row's
    bits still do not depend on its forward (the kernels attend the fp16 keys); a cache made before a
    quantiser switched the model's attention is made anew when the next sequence starts."""
    lm = tiny_lm(0, "q4k", layers=3)
    lm.forward(prompt)
    assert lm.kv_dtype == lm.cache_layers[0].keys.dtype == torch.float32
    quantize_target_q4k(lm.model)  # row-by-row attention: the cache made before is stale
    lm.forward(prompt)  # no reset: it goes on with the old cache
    lm.reset()
    lm.forward(prompt)
    assert all(isinstance(layer, PositionLayer) for layer in lm.cache_layers)
    lm.kv_dtype = torch.float16
    assert lm.cache_layers[0].keys.dtype == torch.float32  # until the next sequence starts
    lm.reset()
    assert_chain_rows_scored_as_one_token_forwards(lm, prompt)
    assert all(layer.keys.dtype == torch.float16 for layer in lm.cache_layers)
    asked = HFCausalLM(lm.model, tokenizer=None, name="asked", kv_dtype=torch.float16)
    lm.reset()
    assert torch.equal(asked.forward(prompt), lm.forward(prompt))
    view = SlotLM(lm, prefill_chunk=4)  # a batch's view of the model: a cache like its base's
    view.forward(prompt)
    assert view.cache_layers[0].keys.dtype == torch.float16
