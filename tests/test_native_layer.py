"""The native decoder layer (:mod:`marspec.backends.native_layer`, ``kernels/layer.cpp``): on every
family (Llama, Mistral, Qwen2, Qwen3's head norms, Gemma 3's norms and GELU) and kind of linear layer it
takes, the direct forward through it stays within float error of the Python layer, on quantised layers
each row's output is the same bits in a prefill, a chain, a tree and alone (so strict decoding
reproduces plain decoding), every x86 path gives the same bits, and a layer it does not write out keeps
the Python layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY_SIZES
from test_direct import row_attention_model
from test_tree import TREE
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from marspec.backends import kernels
from marspec.backends.hf import HFCausalLM
from marspec.backends.int8 import int8_rows
from marspec.backends.int8_planes import Int8PlanesLinear
from marspec.backends.q4k import Q4KLinear
from marspec.backends.q6k import Q6K_BLOCK_BYTES, Q6KLinear
from marspec.backends.quantize import quantize_target_q4k
from marspec.backends.row_attention import use_row_attention

pytestmark = pytest.mark.skipif(not kernels.kernels_available(), reason="marspec's kernels do not run here")


def lms(model: torch.nn.Module) -> tuple[HFCausalLM, HFCausalLM]:
    """Two views of ``model``'s direct forward: through the native layers, and through the Python ones."""
    native, python = (HFCausalLM(model, tokenizer=None, name=n) for n in ("native", "python"))
    assert native.direct is not None and python.direct is not None
    assert all(layer.native is not None for layer in native.direct._layers)
    python.direct.native_layers = False
    return native, python


def assert_close_to_the_python_layer(model: torch.nn.Module, prompt: torch.Tensor, tolerance: float) -> None:
    """A prefill's logits and cache through the native layers within ``tolerance`` (relative to the
    largest value) of the Python layers'."""
    native, python = lms(model)
    ours, theirs = native.forward(prompt), python.forward(prompt)
    assert (ours - theirs).abs().max() <= tolerance * theirs.abs().max()
    for a, b in zip(native.cache_layers, python.cache_layers, strict=True):
        assert (a.keys - b.keys).abs().max() <= tolerance * b.keys.abs().max()


def assert_rows_alone(model: torch.nn.Module, prompt: torch.Tensor) -> None:
    """Each row of a prefill, a chain and a tree is the bits of that token scored alone."""
    lm, alone = lms(model)[0], HFCausalLM(model, tokenizer=None, name="alone")
    prefill = lm.forward(prompt)
    rows = torch.cat([alone.forward(prompt[i : i + 1]) for i in range(len(prompt))])
    assert torch.equal(prefill, rows)
    lm.rollback(3)
    assert torch.equal(lm.forward(prompt[3:]), prefill[3:])  # a chain after a rollback
    lm.rollback(len(prompt) - 1)
    tree = lm.forward_tree(TREE, prompt[-1:])
    assert torch.equal(tree[0], prefill[-1])


def qwen3(layers: int = 3) -> torch.nn.Module:
    """A random Qwen3 (each head's query and key normed) attending row by row."""
    torch.manual_seed(0)
    config = Qwen3Config(**TINY_SIZES, num_hidden_layers=layers, head_dim=16)
    model = Qwen3ForCausalLM(config).eval().requires_grad_(False)
    use_row_attention(model)
    return model


def gemma3(layers: int = 6) -> torch.nn.Module:
    """A random Gemma 3 (head norms, norms of the attention's and MLP's outputs, all scaling by 1 + w,
    GELU): five sliding layers of a window of 4 (shorter than the prompt) and a global one, the norms'
    weights random (Gemma's are zeros at initialisation: 1 + w would be 1)."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        **TINY_SIZES, num_hidden_layers=layers, head_dim=16, query_pre_attn_scalar=16, sliding_window=4
    )
    model = Gemma3ForCausalLM(config).eval().requires_grad_(False)
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):
            parameter.normal_(0.0, 0.5)
    use_row_attention(model)
    return model


FLOAT_MODELS = {
    "qwen2": lambda: row_attention_model("qwen2"),
    "llama": lambda: row_attention_model("llama"),
    "mistral": lambda: row_attention_model("mistral"),
    "qwen3": qwen3,
    "gemma3": gemma3,
}


@pytest.mark.parametrize("kind", FLOAT_MODELS)
def test_float_layers_stay_within_float_error_of_the_python_layer(kind: str, prompt: torch.Tensor) -> None:
    assert_close_to_the_python_layer(FLOAT_MODELS[kind](), prompt, 1e-5)


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
            scales = rng.uniform(-1e-3, 1e-3, size=(*blocks.shape[:2], 1)).astype(np.float16)
            blocks[..., 208:210] = scales.view(np.uint8)
            setattr(parent, name, Q6KLinear.from_gguf_blocks(blocks.reshape(old.out_features, -1), old.bias))
    return model


def padded_q4k_qwen2() -> torch.nn.Module:
    """A random Qwen2 80 wide (intermediate 144, 5 heads of 16): its Q4_K layers pad their rows (not
    multiples of 32)."""
    torch.manual_seed(0)
    heads = {"num_attention_heads": 5, "num_key_value_heads": 1}
    sizes = {**TINY_SIZES, "hidden_size": 80, "intermediate_size": 144, **heads}
    model = Qwen2ForCausalLM(Qwen2Config(**sizes, num_hidden_layers=2)).eval().requires_grad_(False)
    quantize_target_q4k(model)
    assert any(isinstance(m, Q4KLinear) and m.pad > 0 for m in model.modules())
    return model


def int8_planes_qwen2() -> torch.nn.Module:
    """A random Qwen2 80 wide (intermediate 144, 5 heads of 16), every linear layer int8 rows on the Q4_K
    kernel's planes (a GGUF's Q5_0 / Q8_0 / Q4_1 layers), each padded to 128 before it is written twice."""
    torch.manual_seed(0)
    heads = {"num_attention_heads": 5, "num_key_value_heads": 1}
    sizes = {**TINY_SIZES, "hidden_size": 80, "intermediate_size": 144, **heads}
    model = Qwen2ForCausalLM(Qwen2Config(**sizes, num_hidden_layers=2)).eval().requires_grad_(False)
    for name, module in list(model.named_modules()):
        if type(module) is torch.nn.Linear:
            model.set_submodule(name, Int8PlanesLinear.from_int8_rows(*int8_rows(module.weight), module.bias))
    use_row_attention(model)
    assert any(isinstance(m, Int8PlanesLinear) and m.pad > 0 for m in model.modules())
    return model


def q4k(model: torch.nn.Module) -> torch.nn.Module:
    quantize_target_q4k(model)
    return model


QUANTISED = [
    q4k_and_q6k_llama,
    padded_q4k_qwen2,
    int8_planes_qwen2,
    lambda: q4k(qwen3()),
    lambda: q4k(gemma3()),
]
QUANTISED_IDS = ["q4k_q6k", "padded_q4k", "int8_planes", "qwen3_q4k", "gemma3_q4k"]


@pytest.mark.parametrize("make", QUANTISED, ids=QUANTISED_IDS)
def test_quantised_layers_give_each_row_its_own_bits(make, prompt: torch.Tensor) -> None:
    model = make()
    assert_rows_alone(model, prompt)
    # The int8 rounding of activations moves with the float error: a little more than float layers.
    assert_close_to_the_python_layer(model, prompt, 2e-2)


def counted(obj: object, method: str) -> list[int]:
    """Calls of ``obj.method`` from now on, one entry each."""
    calls: list[int] = []
    call = getattr(obj, method)
    setattr(obj, method, lambda *args: calls.append(1) or call(*args))
    return calls


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["float32", "fp16"])
@pytest.mark.parametrize("make", QUANTISED, ids=QUANTISED_IDS)
def test_one_call_a_model_and_one_a_layer_give_the_bits_of_the_halves_around_the_attention(
    make, prompt, kv_dtype
) -> None:
    """Caches of either dtype: every layer in one call (the chain), each layer in one, and each in two
    around the attention write and score the same bits (fp16 rounded as torch's copy into the Python
    layer's cache rounds it)."""
    model = make()
    whole, layered, halves = (
        HFCausalLM(model, tokenizer=None, name=n, kv_dtype=kv_dtype) for n in ("whole", "layered", "halves")
    )
    layered.direct.one_call = halves.direct.one_call = False
    for layer in halves.direct._layers:
        layer.native.steps = False
    chains = counted(whole.direct._chain, "step")
    steps = counted(layered.direct._layers[-1].native, "step")  # Gemma's last layer is a global one
    lms = (whole, layered, halves)
    calls = 3
    for tokens in (prompt[:5], prompt[5:6], prompt[6:]):  # a prefill, a step, a verification chain
        ours, *others = (lm.forward(tokens) for lm in lms)
        assert all(torch.equal(ours, other) for other in others)
    assert len(chains) == calls and len(steps) == 3
    base = whole.cached_len
    ours, *others = (lm.forward_tree(TREE, prompt[-1:]) for lm in lms)  # a tree: the halves, in every view
    assert all(torch.equal(ours, other) for other in others)
    assert len(chains) == calls and len(steps) == 3
    for lm in lms:
        lm.keep_path(base, (3,))
    assert whole.cache_layers[0].keys.dtype == kv_dtype
    for lm in (layered, halves):
        for a, b in zip(whole.cache_layers, lm.cache_layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_the_one_call_model_refuses_lists_that_do_not_match_its_layers() -> None:
    chain = HFCausalLM(q4k_and_q6k_llama(), tokenizer=None, name="native").direct._chain
    norms, linears, family = chain._norms, chain._linears, chain._family
    hidden, caches = torch.zeros(1, 1, 256), [torch.zeros(1, 2, 8, 64)] * len(norms[0])
    cos = sin = [torch.zeros(1, 1, 1, 64)] * len(norms[0])
    step, shorter = kernels.ops().layers_step, lambda lists: (part[:-1] for part in lists)
    with pytest.raises(RuntimeError, match="7 linear layers a layer"):
        step(hidden, *norms, *shorter(linears), cos, sin, 64, caches, caches, 0, 0.125, *family)
    with pytest.raises(RuntimeError, match="two cache buffers"):
        step(hidden, *norms, *linears, cos, sin, 64, caches[:-1], caches, 0, 0.125, *family)
    with pytest.raises(RuntimeError, match="its rotation's cos and sin"):
        step(hidden, *norms, *linears, cos[:-1], sin, 64, caches, caches, 0, 0.125, *family)
    with pytest.raises(RuntimeError, match="its family's norms"):
        step(hidden, *norms, *linears, cos, sin, 64, caches, caches, 0, 0.125, *shorter(family))


@pytest.mark.parametrize("make", [q4k_and_q6k_llama, lambda: q4k(gemma3())], ids=["llama", "gemma3"])
def test_every_x86_path_gives_the_native_layers_bits(make) -> None:
    model = make()
    layer = HFCausalLM(model, tokenizer=None, name="native").direct._layers[0].native
    width, heads, d = model.config.hidden_size, model.config.num_attention_heads, layer._head_dim
    torch.manual_seed(1)
    hidden = torch.randn(1, 5, width)
    cos, sin = torch.randn(1, 1, 5, d), torch.randn(1, 1, 5, d)
    attended = torch.randn(1, 5, heads, d)
    outputs = []
    for path in kernels.runnable_paths():
        if path.amx:
            continue  # rides on avx512_vnni's library
        ops = kernels.library_ops(path)
        pre = ops.layer_pre(hidden, *layer._input_norm, *layer._qkv, cos, sin, d, *layer._head_norms)
        post = ops.layer_post(
            hidden, attended, *layer._pre_mlp_norm, *layer._o_mlp, *layer._output_norms, layer.activation
        )
        outputs.append((path.name, [*pre, post]))
    for name, tensors in outputs[1:]:
        for ours, first in zip(tensors, outputs[0][1], strict=True):
            assert torch.equal(ours, first), f"{name} differs from {outputs[0][0]}"


def test_a_layer_with_two_head_norm_epsilons_or_an_activation_it_lacks_keeps_the_python_layer() -> None:
    model = qwen3(layers=2)
    model.model.layers[0].self_attn.k_norm.variance_epsilon = 1e-3  # q's is 1e-6: one epsilon is taken
    model.config.hidden_act = "relu"  # asked of every layer
    lm = HFCausalLM(model, tokenizer=None, name="qwen3")
    assert lm.direct is not None
    assert all(layer.native is None for layer in lm.direct._layers)
    model.config.hidden_act = "silu"
    layers = HFCausalLM(model, tokenizer=None, name="qwen3").direct._layers
    assert layers[0].native is None and layers[1].native is not None
