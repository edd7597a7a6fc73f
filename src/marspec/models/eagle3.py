"""EAGLE-3 heads in the format they are published in: recognising one, and checking it fits a target
before any weights load.

A head is a folder (or a Hub id's snapshot) whose ``config.json`` names the architecture
``LlamaForCausalLMEagle3`` (SpecForge, vLLM and SGLang publish and load this layout). Its safetensors
hold ``fc`` (the target's hidden states of three layers, side by side, to the head's width), one decoder
layer ``midlayer.*`` whose attention reads the token embedding and the hidden state side by side, a
final ``norm``, an ``lm_head`` over a reduced draft vocabulary, and the maps ``d2t`` (target id = draft
id + ``d2t[draft id]``) and ``t2d`` (which target ids the draft vocabulary holds). The token embedding is
the target's unless the head carries ``embed_tokens``.

Everything here reads configs, safetensors headers and the two small maps only; the weights themselves
are loaded by :func:`marspec.drafters.eagle3_head.load_head` once :func:`check_fits` has passed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from marspec.errors import MarspecError, one_line

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class TargetShape:
    """What a head must agree with: the target's hidden width, layer count and vocabulary (LM-head rows)."""

    name: str
    hidden_size: int
    num_layers: int
    vocab_size: int

    @classmethod
    def of_config(cls, name: str, config: dict) -> TargetShape:
        text = config.get("text_config") or config  # a multimodal config nests its language model's
        return cls(name, int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"]))


@dataclass(frozen=True)
class HeadSpec:
    """An EAGLE-3 head's configuration and the shapes of its tensors, read without loading them."""

    name: str
    folder: Path
    config: dict
    shapes: dict[str, tuple[int, ...]]  # tensor name -> shape, from the safetensors headers
    files: tuple[Path, ...]  # its safetensors files

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def target_hidden_size(self) -> int:
        return int(self.config.get("target_hidden_size") or self.hidden_size)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.config.get("draft_vocab_size") or self.config["vocab_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def num_heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(self.config.get("head_dim") or self.hidden_size // self.num_heads)

    @property
    def has_embedding(self) -> bool:
        return "embed_tokens.weight" in self.shapes

    def layers(self, target_layers: int) -> tuple[int, ...]:
        """The target layers whose hidden states feed the head (layer ``i``: the stream entering target
        layer ``i``; see :class:`marspec.interfaces.HiddenStates`): the config's
        ``eagle_config.eagle_aux_hidden_state_layer_ids`` where it names them, else EAGLE-3's default, an
        early, a middle and a late layer ``(2, L // 2, L - 3)``."""
        eagle = self.config.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") or self.config.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        if ids:
            return tuple(int(i) for i in ids)
        return default_layers(target_layers)


def default_layers(target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default feature layers for a target of ``target_layers`` decoder layers."""
    return (2, target_layers // 2, target_layers - 3)


def _architectures(config: dict) -> list[str]:
    names = config.get("architectures") or []
    return [str(n) for n in names] if isinstance(names, list) else [str(names)]


def is_head_config(config: dict) -> bool:
    """Whether a model config describes an EAGLE-3 head (any architecture named for EAGLE-3)."""
    return any("eagle3" in name.lower() for name in _architectures(config))


def find_head(name: str | os.PathLike[str]) -> HeadSpec | None:
    """The head that ``name`` (a folder or a Hub id) holds, or None when it is no EAGLE-3 head (a model
    name, a .gguf file, a causal LM folder). A Hub id is resolved (fetched when online) to tell."""
    from marspec.models.hub import hub_snapshot, names_hub_model
    from marspec.models.registry import MODELS

    text = os.fspath(name)
    if text in MODELS or text in ("none", "ngram"):
        return None
    hub = names_hub_model(name)
    if hub:  # its configuration first: a draft model's weights are not needed to tell it is no head
        folder = hub_snapshot(text, weights=False)
    else:
        folder = Path(text).expanduser()
        if not folder.is_dir():
            return None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not is_head_config(config):
        return None
    return _read_head(text, hub_snapshot(text) if hub else folder, config)


def _read_head(name: str, folder: Path, config: dict) -> HeadSpec:
    from safetensors import safe_open

    archs = _architectures(config)
    if not any(a in ARCHITECTURES for a in archs):
        raise MarspecError(
            f"EAGLE-3 head {name!r} has architecture {', '.join(archs)}; marspec runs heads of the Llama "
            f"layout ({ARCHITECTURES[0]}), the one SpecForge, vLLM and SGLang publish"
        )
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise MarspecError(
            f"EAGLE-3 head {name!r} has {config['num_hidden_layers']} decoder layers; marspec runs one-layer "
            "heads (num_hidden_layers 1, the published EAGLE-3 format)"
        )
    missing = [key for key in ("hidden_size", "num_attention_heads", "vocab_size") if key not in config]
    if missing:
        raise MarspecError(f"EAGLE-3 head {name!r}: its config.json lacks {', '.join(missing)}")
    files = tuple(sorted(folder.glob("*.safetensors")))
    if not files:
        raise MarspecError(
            f"EAGLE-3 head {name!r} has no safetensors weights in {folder} (a pytorch_model.bin head must be "
            "converted first: load it with torch.load and save it with safetensors.torch.save_file)"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        for file in files:
            with safe_open(str(file), "pt") as f:
                for key in list(f.keys()):
                    shapes[key.removeprefix("model.")] = tuple(f.get_slice(key).get_shape())
    except Exception as exc:
        raise MarspecError(
            f"EAGLE-3 head {name!r}: cannot read {folder}'s safetensors ({one_line(exc)})"
        ) from None
    spec = HeadSpec(name, folder, config, shapes, files)
    _check_own_shapes(spec)
    return spec


def _expected_shapes(spec: HeadSpec, feature_layers: int) -> dict[str, tuple[int, ...]]:
    h, d = spec.hidden_size, spec.head_dim
    inter = int(spec.config.get("intermediate_size", 0))
    shapes = {
        "fc.weight": (h, feature_layers * spec.target_hidden_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (spec.num_heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (spec.num_kv_heads * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (spec.num_kv_heads * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, spec.num_heads * d),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (spec.draft_vocab_size, h),
    }
    if spec.draft_vocab_size != spec.vocab_size or "d2t" in spec.shapes:
        shapes["d2t"] = (spec.draft_vocab_size,)
    return shapes


def _check_own_shapes(spec: HeadSpec) -> None:
    """A head whose tensors disagree with its own config is malformed, whatever the target."""
    fc = spec.shapes.get("fc.weight")
    feature_layers = 3 if fc is None or fc[1] % spec.target_hidden_size else fc[1] // spec.target_hidden_size
    expected = _expected_shapes(spec, feature_layers)
    missing = [key for key in expected if key not in spec.shapes]
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise MarspecError(
            f"EAGLE-3 head {spec.name!r} lacks {len(missing)} tensors ({shown}): it is not in the published "
            "EAGLE-3 format (fc, midlayer.*, norm, lm_head, d2t)"
        )
    for key, shape in expected.items():
        if spec.shapes[key] != shape:
            raise MarspecError(
                f"EAGLE-3 head {spec.name!r}: {key} is {list(spec.shapes[key])} but its config.json implies "
                f"{list(shape)}: the config and the weights are of different heads"
            )
    if "embed_tokens.weight" in spec.shapes and spec.shapes["embed_tokens.weight"] != (
        spec.vocab_size,
        spec.hidden_size,
    ):
        raise MarspecError(
            f"EAGLE-3 head {spec.name!r}: embed_tokens.weight is {list(spec.shapes['embed_tokens.weight'])}, "
            f"not [vocab_size, hidden_size] = [{spec.vocab_size}, {spec.hidden_size}]"
        )


def draft_to_target(spec: HeadSpec) -> torch.Tensor:
    """long[draft vocab]: the target id of each draft id (``d2t``'s offsets applied; identity without
    ``d2t``). Reads the one small tensor."""
    if "d2t" not in spec.shapes:
        return torch.arange(spec.draft_vocab_size)
    return torch.arange(spec.draft_vocab_size) + _tensor(spec, "d2t").long()


def _tensor(spec: HeadSpec, key: str) -> torch.Tensor:
    from safetensors import safe_open

    for file in spec.files:
        with safe_open(str(file), "pt") as f:
            names = set(f.keys())
            for stored in (key, f"model.{key}"):
                if stored in names:
                    return f.get_tensor(stored)
    raise KeyError(key)


def check_fits(spec: HeadSpec, target: TargetShape) -> tuple[int, ...]:
    """Refuse, in one line, a head that does not fit ``target`` (widths, layers, vocabulary, maps);
    return the target layers that feed it. Reads only the configs, headers and maps."""
    head, who = spec.name, f"target {target.name!r}"
    trained = "it was made for another target: use the head published for this target"
    if spec.target_hidden_size != target.hidden_size:
        raise MarspecError(
            f"EAGLE-3 head {head!r} reads hidden states {spec.target_hidden_size} wide but {who}'s are "
            f"{target.hidden_size}: {trained}"
        )
    layers = spec.layers(target.num_layers)
    fc_in = spec.shapes["fc.weight"][1]
    if fc_in != len(layers) * target.hidden_size:
        raise MarspecError(
            f"EAGLE-3 head {head!r}: fc takes {fc_in} inputs, not {len(layers)} layers x "
            f"{target.hidden_size} (the feature layers {list(layers)} of {who}): the head is malformed"
        )
    outside = [i for i in layers if not 0 <= i <= target.num_layers]
    if outside:
        raise MarspecError(
            f"EAGLE-3 head {head!r} reads layers {list(layers)} but {who} has {target.num_layers} "
            f"(layers 0 to {target.num_layers}): {trained}"
        )
    if not spec.has_embedding and spec.hidden_size != target.hidden_size:
        raise MarspecError(
            f"EAGLE-3 head {head!r} is {spec.hidden_size} wide and carries no token embedding, so it needs "
            f"the target's, which is {target.hidden_size} wide ({who}): {trained}"
        )
    if spec.vocab_size != target.vocab_size:
        raise MarspecError(
            f"EAGLE-3 head {head!r} maps its drafts into a vocabulary of {spec.vocab_size} tokens but {who} "
            f"has {target.vocab_size}: {trained}"
        )
    ids = draft_to_target(spec)
    if int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size:
        raise MarspecError(
            f"EAGLE-3 head {head!r}: its d2t map sends draft ids to target ids {int(ids.min())}.."
            f"{int(ids.max())}, outside {who}'s vocabulary of {target.vocab_size}: {trained}"
        )
    if int(ids.unique().numel()) != int(ids.numel()):
        raise MarspecError(
            f"EAGLE-3 head {head!r}: its d2t map sends two draft ids to one target id, so its probabilities "
            "cannot be mapped to the target's vocabulary: the head is malformed"
        )
    if "t2d" in spec.shapes:
        t2d = _tensor(spec, "t2d").bool()
        if t2d.numel() != target.vocab_size or int(t2d.sum()) != ids.numel() or not bool(t2d[ids].all()):
            raise MarspecError(
                f"EAGLE-3 head {head!r}: its t2d map ({t2d.numel()} entries, {int(t2d.sum())} set) does not "
                f"mark the {ids.numel()} target ids d2t names in {who}'s vocabulary of {target.vocab_size}: "
                "the maps are of different heads"
            )
    return layers


def target_shape(target: str | os.PathLike[str]) -> TargetShape:
    """The shape of a target named by name, path or Hub id, from its config.json (no weights loaded)."""
    from marspec.models.convert import resolve_model_dir

    folder = resolve_model_dir(target)
    try:
        return TargetShape.of_config(os.fspath(target), json.loads((folder / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MarspecError(
            f"cannot read the config of target {os.fspath(target)!r} in {folder} ({one_line(exc)})"
        ) from None
