"""The direct decoder forward (:mod:`marspec.backends.direct`): on every architecture it takes it gives
transformers' forward's bits (logits and cache), for chains, a prefill and token trees, and a packed
batch of sequences gives each sequence those bits; models it does not take keep transformers' forward."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_SIZES, tiny_lm
from test_tree import TREE
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from marspec.backends.direct import direct_forward
from marspec.backends.hf import HFCausalLM
from marspec.backends.packed import forward_packed
from marspec.backends.quantize import quantize_target_int8, rowwise_int8_available
from marspec.backends.row_attention import use_row_attention


def row_attention_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A random 3-layer model of ``kind`` attending row by row, as the CPU engines' models do."""
    torch.manual_seed(seed)
    if kind == "qwen2":
        model = tiny_lm(seed, layers=3).model  # biases on q, k and v
    elif kind == "llama":  # llama3 rope scaling: the rotary embedding's own frequencies
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        }
        model = LlamaForCausalLM(LlamaConfig(**TINY_SIZES, num_hidden_layers=3, rope_parameters=rope)).eval()
    else:
        model = MistralForCausalLM(
            MistralConfig(**TINY_SIZES, num_hidden_layers=3, sliding_window=None)
        ).eval()
    model.requires_grad_(False)
    use_row_attention(model)
    return model


def transformers_lm(model: torch.nn.Module) -> HFCausalLM:
    """``model`` behind transformers' forward: a model keeping hidden states takes it."""
    lm = HFCausalLM(model, tokenizer=None, name="transformers")
    lm.capture_hidden_states((1,))
    assert lm.direct is None
    return lm


def assert_same_caches(a: HFCausalLM, b: HFCausalLM) -> None:
    assert a.cached_len == b.cached_len
    for la, lb in zip(a.cache_layers, b.cache_layers, strict=True):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


def assert_same_forwards(a: HFCausalLM, b: HFCausalLM, prompt: torch.Tensor) -> None:
    """``a`` and ``b`` give the same logits and cache bits for one token, a chain, a token tree and a
    prefill of ``prompt``."""
    for lm in (a, b):
        lm.forward(prompt[:5], last_only=True)
    assert torch.equal(a.forward(prompt[:1]), b.forward(prompt[:1]))  # one token
    assert torch.equal(a.forward(prompt[5:]), b.forward(prompt[5:]))  # a chain
    base = a.cached_len
    assert torch.equal(*(lm.forward_tree(TREE, prompt[-1:]) for lm in (a, b)))
    for lm in (a, b):
        lm.keep_path(base, (3,))
    assert_same_caches(a, b)
    for lm in (a, b):
        lm.reset()
    assert torch.equal(a.forward(prompt), b.forward(prompt))  # a prefill's every row
    assert_same_caches(a, b)


@pytest.mark.parametrize("kind", ["qwen2", "llama", "mistral"])
def test_the_direct_forward_gives_transformers_bits(kind: str, prompt: torch.Tensor) -> None:
    model = row_attention_model(kind)
    direct, reference = HFCausalLM(model, tokenizer=None, name="direct"), transformers_lm(model)
    assert direct.direct is not None
    direct.direct.native_layers = False  # the native layer's bits are its own (tests/test_native_layer.py)
    assert_same_forwards(direct, reference, prompt)


@pytest.mark.skipif(not rowwise_int8_available(), reason="no oneDNN int8 kernels in this torch build or CPU")
def test_a_packed_batch_on_the_direct_forward_gives_each_sequence_transformers_bits() -> None:
    model = tiny_lm(0, layers=3).model
    quantize_target_int8(model)  # int8 rows and row-by-row attention: sequences pack exactly
    prompts = [torch.tensor([5, 17, 42, 8]), torch.tensor([63, 5]), torch.tensor([9, 9, 9, 1, 2, 3])]
    packed = [HFCausalLM(model, tokenizer=None, name=f"s{i}") for i in range(3)]
    alone = [transformers_lm(model) for _ in range(3)]
    assert packed[0].direct is not None
    for lm, p in zip(alone, prompts, strict=True):
        lm.forward(p[:-1])
    first = forward_packed([(lm, p[:-1], False) for lm, p in zip(packed, prompts, strict=True)])
    second = forward_packed([(lm, p[-1:], True) for lm, p in zip(packed, prompts, strict=True)])
    for i, (lm, p) in enumerate(zip(alone, prompts, strict=True)):
        assert torch.equal(second[i], lm.forward(p[-1:], last_only=True))
        lm.rollback(0)
        assert torch.equal(first[i], lm.forward(p[:-1]))
        lm.forward(p[-1:])
        assert_same_caches(packed[i], lm)


def test_models_it_does_not_write_out_keep_transformers_forward() -> None:
    plain = tiny_lm(0).model  # attention by SDPA: transformers' forward
    assert direct_forward(plain) is None
    bf16 = row_attention_model("qwen2").to(torch.bfloat16)
    assert direct_forward(bf16) is None
    model = row_attention_model("llama")
    assert direct_forward(model) is not None
    model.config.model_type = "olmo"  # another decoder layer
    assert direct_forward(model) is None
