"""The head a run trains: its config (the published EAGLE-3 format), its initial weights, and saving it
where marspec loads it (``draft=<run>/head``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from marspec.drafters.eagle3_head import Eagle3Head
from marspec.models.eagle3 import HeadSpec

if TYPE_CHECKING:
    from marspec.backends.hf import HFCausalLM


def head_config(target_config: dict, draft_vocab: int, intermediate: int, layers: tuple[int, ...]) -> dict:
    """The config of a head for a target with ``target_config``: one layer of the target's width and
    attention shape, an MLP ``intermediate`` wide, reading the target's ``layers``."""
    hidden = target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    rope_theta = target_config.get("rope_theta") or (target_config.get("rope_parameters") or {}).get(
        "rope_theta", 10000.0
    )
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": target_config.get("num_key_value_heads", heads),
        "head_dim": target_config.get("head_dim") or hidden // heads,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": target_config["rms_norm_eps"],
        "rope_theta": rope_theta,
        "max_position_embeddings": target_config["max_position_embeddings"],
        "vocab_size": target_config["vocab_size"],
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": hidden,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)},
    }


def spec_of(config: dict, with_maps: bool = True) -> HeadSpec:
    """A :class:`HeadSpec` for a head made here (no files yet): the shapes its config implies."""
    shapes = {"d2t": (int(config["draft_vocab_size"]),)} if with_maps else {}
    return HeadSpec("trained", Path("."), config, shapes, ())


def new_head(target: HFCausalLM, config: dict, layers: tuple[int, ...]) -> Eagle3Head:
    """A float32 head of ``config`` over the target's token embedding (its weights not yet set)."""
    head = Eagle3Head(spec_of(config), len(layers), target.model.get_input_embeddings())
    head.float()
    head.rotary.float()
    return head


@torch.no_grad()
def initialise_head(head: Eagle3Head, target: HFCausalLM, draft_ids: torch.Tensor) -> None:
    """A new head's weights: random, but for the output side, which starts as the target's own (its
    final norm and its output rows of the draft vocabulary), and the draft-to-target maps."""
    for name, p in head.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dim() == 2:
            p.normal_(0.0, 0.02)
    # ``fc`` starts random like the layer: passing the late feature layer on unchanged (tried first) made
    # the head predict, confidently, the token one position early (eval loss 18.7) and it learnt slower
    # than a bigram table.
    head.norm.weight.copy_(target.model.get_decoder().norm.weight.float())
    head.lm_head.weight.copy_(target.model.get_output_embeddings().weight[draft_ids].float())
    head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
    head.t2d.zero_().index_fill_(0, draft_ids, True)


def save_head(head: Eagle3Head, config: dict, folder: Path) -> None:
    """Write the head to ``folder`` (``config.json`` + ``model.safetensors``), replacing it whole."""
    from safetensors.torch import save_file

    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary")}
    save_file(state, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if folder.exists():
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    tmp.rename(folder)
