"""EAGLE-3 heads the tests build, written in the published format (``config.json`` with
``LlamaForCausalLMEagle3``; safetensors ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``) by
tensor name, independently of marspec's own head module, so loading them tests marspec's reading of that
format.

No trained head exists for these targets here, so a head is made to draft by construction (as
tests_vllm/test_eagle3.py makes its head): ``fc`` passes on the output of the target's last layer
(feature layer L), ``norm`` is the target's final norm and ``lm_head`` the target's output rows of a few
tokens (the draft vocabulary), while the decoder layer's attention and MLP weights are small random
noise. So at position ``p`` the head ranks the draft vocabulary as the target ranks it at ``p``: first,
the token the target has just emitted, ``a``. The ``d2t`` map then turns that into a proposal for
``p + 2``: a table ``proposals[a]`` read off the target's own plain decoding, either the token that
followed ``a`` there (the head then drafts what the target takes) or the target's runner-up after ``a``
(it then drafts what MARS may relax to). Past its first token a draft repeats itself (the head's own
output is fed forward as the next feature, which ranks as the last one did), so drafts of two tokens
and more are rejected partway: both outcomes occur.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

NOISE = 0.01  # std of the random attention and MLP weights
INTERMEDIATE = 64  # the random MLP's width unless a caller asks for another


def bigram_proposals(sequences: list[list[int]], followers: list[list[int]]) -> dict[int, int]:
    """One proposal per token: after token ``sequences[r][i]`` (its first occurrence), propose
    ``followers[r][i + 1]``; each proposed token for one token only (``d2t`` is one-to-one)."""
    proposals: dict[int, int] = {}
    for tokens, follow in zip(sequences, followers, strict=True):
        for i, (previous, _) in enumerate(itertools.pairwise(tokens)):
            token = follow[i + 1]
            if previous not in proposals and token not in proposals.values():
                proposals[previous] = token
    return proposals


def target_tensors(folder: Path, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A target folder's final norm weight and its output rows ``rows`` (``lm_head``, or the token
    embedding when the two are tied), read row by row without loading the rest."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        output = f.get_slice("lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight")
        return f.get_tensor("model.norm.weight"), torch.cat([output[r : r + 1] for r in rows])


def write_head(
    folder: Path,
    target_config: dict,
    target_dir: Path,
    proposals: dict[int, int],
    seed: int = 0,
    layers: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
    config_changes: dict | None = None,
    drop: tuple[str, ...] = (),
    intermediate: int = INTERMEDIATE,
) -> Path:
    """Write a head for the target in ``target_dir`` (its config.json as ``target_config``) into
    ``folder``. ``layers`` goes to ``eagle_config`` (None: the config names
    none, and EAGLE-3's default applies; then ``fc`` reads the late layer instead of layer L).
    ``config_changes`` and ``drop`` (tensor names left out) make misfit heads; ``intermediate`` is the
    random MLP's width. The vLLM tests (tests_vllm/test_eagle3.py) build their heads with it too."""
    hidden = target_config["hidden_size"]
    heads, kv_heads = target_config["num_attention_heads"], target_config["num_key_value_heads"]
    head_dim = target_config.get("head_dim") or hidden // heads
    rope_theta = target_config.get("rope_theta") or (target_config.get("rope_parameters") or {}).get(
        "rope_theta", 10000.0
    )
    sources = sorted(proposals)  # draft id i reads the target's output row of sources[i]
    g = torch.Generator().manual_seed(seed)

    def noise(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * NOISE

    final_norm, output = target_tensors(target_dir, sources)
    fc = torch.zeros(hidden, 3 * hidden)  # passes on the last of the three feature layers
    fc[:, 2 * hidden :] = torch.eye(hidden)
    drafted = torch.tensor([proposals[a] for a in sources])
    vocab = target_config["vocab_size"]
    tensors = {
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": noise(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": noise(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": noise(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": noise(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": noise(intermediate, hidden),
        "midlayer.mlp.up_proj.weight": noise(intermediate, hidden),
        "midlayer.mlp.down_proj.weight": noise(hidden, intermediate),
        "fc.weight": fc,
        "norm.weight": final_norm.float(),
        "lm_head.weight": output.float(),
    }
    tensors = {name: t.to(dtype).contiguous() for name, t in tensors.items()}
    tensors["d2t"] = drafted - torch.arange(len(sources))  # target id = draft id + d2t[draft id]
    # (A map into another vocabulary, made to be refused, marks only the ids this one has.)
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, drafted[drafted < vocab], True)
    for name in drop:
        del tensors[name]
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": target_config["rms_norm_eps"],
        "rope_theta": rope_theta,
        "max_position_embeddings": target_config["max_position_embeddings"],
        "vocab_size": vocab,
        "draft_vocab_size": len(sources),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "target_hidden_size": hidden,
    }
    if layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers}
    config.update(config_changes or {})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def last_layer_ids(n_layers: int) -> list[int]:
    """Feature layers whose last is the target's last layer output (what ``fc`` passes on)."""
    return [min(2, n_layers), n_layers // 2, n_layers]
