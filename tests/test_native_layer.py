"""The native decoder layer (:mod:`marspec.backends.native_layer`, ``kernels/layer.cpp``): on every
family and kind of linear layer it takes, the direct forward through it gives the Python layer's bits
(logits and cache) for a prefill, one token, a chain and a token tree; other families keep the Python
layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY_SIZES
from test_direct import assert_same_forwards, row_attention_model
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from marspec.backends.hf import HFCausalLM
from marspec.backends.kernels import kernels_available
from marspec.backends.q4k import Q4KLinear
from marspec.backends.q6k import Q6K_BLOCK_BYTES, Q6KLinear
from marspec.backends.quantize import quantize_target_q4k
from marspec.backends.row_attention import use_row_attention

pytestmark = pytest.mark.skipif(not kernels_available(), reason="marspec's kernels do not run here")


def lms(model: torch.nn.Module) -> tuple[HFCausalLM, HFCausalLM]:
    """Two views of ``model``'s direct forward: through the native layers, and through the Python ones."""
    native, python = (HFCausalLM(model, tokenizer=None, name=n) for n in ("native", "python"))
    assert native.direct is not None and python.direct is not None
    python.direct.native_layers = False
    return native, python


def assert_same_bits(model: torch.nn.Module, prompt: torch.Tensor) -> None:
    native, python = lms(model)
    assert all(layer.native is not None for layer in native.direct._layers)
    assert_same_forwards(native, python, prompt)


@pytest.mark.parametrize("kind", ["qwen2", "llama", "mistral"])
def test_float_layers_give_the_python_layers_bits(kind: str, prompt: torch.Tensor) -> None:
    assert_same_bits(row_attention_model(kind), prompt)


def q4k_and_q6k_llama() -> torch.nn.Module:
    """A random 2-layer Llama 256 wide, its linear layers Q4_K, each layer's v and down Q6_K (as in a
    Q4_K_M file), with biases on q, k and v as Qwen2's."""
    torch.manual_seed(0)
    sizes = {**TINY_SIZES, "hidden_size": 256, "intermediate_size": 512}
    model = LlamaForCausalLM(LlamaConfig(**sizes, num_hidden_layers=2, attention_bias=True)).eval()
    model.requires_grad_(False)
    quantize_target_q4k(model)
    rng = np.random.default_rng(0)
    for layer in model.model.layers:
        for parent, name in ((layer.self_attn, "v_proj"), (layer.mlp, "down_proj")):
            old = getattr(parent, name)
            blocks = rng.integers(0, 256, size=(old.out_features, old.in_features // 256, Q6K_BLOCK_BYTES))
            blocks = blocks.astype(np.uint8)
            blocks[..., 208:210] = (
                rng.uniform(-1e-3, 1e-3, size=(*blocks.shape[:2], 1)).astype(np.float16).view(np.uint8)
            )
            setattr(parent, name, Q6KLinear.from_gguf_blocks(blocks.reshape(old.out_features, -1), old.bias))
    return model


def test_q4k_and_q6k_layers_give_the_python_layers_bits(prompt: torch.Tensor) -> None:
    assert_same_bits(q4k_and_q6k_llama(), prompt)


def test_a_q4k_model_whose_rows_the_layers_pad_gives_the_python_layers_bits(prompt: torch.Tensor) -> None:
    torch.manual_seed(0)
    sizes = {**TINY_SIZES, "hidden_size": 80, "intermediate_size": 144}  # not multiples of 32
    model = Qwen2ForCausalLM(Qwen2Config(**sizes, num_hidden_layers=2)).eval().requires_grad_(False)
    quantize_target_q4k(model)
    assert any(isinstance(m, Q4KLinear) and m.pad > 0 for m in model.modules())
    assert_same_bits(model, prompt)


def test_a_family_with_head_norms_keeps_the_python_layer() -> None:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY_SIZES, num_hidden_layers=2, head_dim=16)).eval()
    use_row_attention(model)
    lm = HFCausalLM(model, tokenizer=None, name="qwen3")
    assert lm.direct is not None
    assert all(layer.native is None for layer in lm.direct._layers)
