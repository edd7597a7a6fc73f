"""A converted folder's model for the CPU engines: written once from its GGUF (or its float32 weights) a
tensor at a time, then loaded from that file in seconds.

Three forms. ``"int8"`` (a target's ``target_quant="int8"``): every linear layer holds int8 weights and
per-row float32 scales, as the int8 kernel takes them (:func:`~marspec.backends.int8.int8_rows`; a tied
LM head's from the embedding's weight). ``"q4k"`` (``target_quant="q4k"``): a linear layer whose GGUF
weights are Q4_K or Q6_K keeps those blocks, repacked for the kernels
(:class:`~marspec.backends.q4k.Q4KLinear`, :class:`~marspec.backends.q6k.Q6KLinear`: the file's own
weights, no second rounding), and a GGUF's layers of other types (Q5_0, Q8_0, float) are int8 rows as
above, held as the two 4-bit planes the Q4_K kernel runs them as
(:class:`~marspec.backends.int8_planes.Int8PlanesLinear`: the same values); a float checkpoint's layers
are quantised to Q4_K. ``"q4k-draft"`` (``draft_quant="q4k"``): every layer on
the Q4_K kernel, the finer ones quantised to Q4_K too, since a draft only proposes and its step's cost
is what counts. In every form the token embedding is int8 with a scale per group of channels
(:func:`~marspec.backends.int8.int8_groups`) and everything else (norms, biases) float32. Writing it
reads one GGUF tensor at a time (dequantized where it is not kept,
:func:`~marspec.models.gguf_weights.gguf_tensors_keeping`) and converts it at once, so neither disk nor
memory ever holds the float32 model; a folder holding float32 weights instead is read the same way.

Plain arrays, so unlike the 4-bit store the file does not depend on the torch release or the CPU that
wrote it; oneDNN's blocked layout is made from it on load (:class:`RowwiseInt8Linear`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from marspec.backends.int8 import (
    INT8_UNAVAILABLE,
    Int8Embedding,
    RowwiseInt8Linear,
    embedding_scale,
    int8_groups,
    int8_rows,
    rowwise_int8_available,
)
from marspec.backends.memory import release_pages, trim_heap
from marspec.backends.row_attention import use_row_attention
from marspec.errors import MarspecError, one_line
from marspec.models.cache import WEIGHTS_FILE, share_file
from marspec.models.convert import folder_gguf
from marspec.models.gguf_int4 import complete, empty_model, name_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger("marspec")

# Each form's file format, bumped when what the file holds changes: a file of another is written again.
_FORMATS = {"int8": "2", "q4k": "q4k-5", "q4k-draft": "q4k-draft-3"}
_INT8, _SCALE = "int8_weight", "weight_scale"
_Q4K = "q4k_"  # the prefix of a Q4_K layer's tensors (Q4KLinear.tensors' names after it)
_PLANES = "i8planes_"  # the prefix of an int8 layer's planes (Int8PlanesLinear.tensors' names after it)


class _BlockType(NamedTuple):
    """A GGUF block type that the Q4_K forms keep: its layer class, its dequantiser and the prefix of
    its layers' tensors in the file (the class's ``tensors`` names after it)."""

    layer: type[torch.nn.Module]
    dequantize: Callable[[np.ndarray], torch.Tensor]
    prefix: str


def _block_types() -> dict[object, _BlockType]:
    """The block types kept, by GGUF type (imported on use: the kernels' modules are the q4k forms')."""
    from gguf import GGMLQuantizationType

    from marspec.backends.q4k import Q4KLinear, dequantize_q4k
    from marspec.backends.q6k import Q6KLinear, dequantize_q6k

    return {
        GGMLQuantizationType.Q4_K: _BlockType(Q4KLinear, dequantize_q4k, _Q4K),
        GGMLQuantizationType.Q6_K: _BlockType(Q6KLinear, dequantize_q6k, "q6k_"),
    }


def _stored_layers() -> list[tuple[type[torch.nn.Module], str]]:
    """The layer classes a Q4_K form's file holds by their tensors' prefix: the kept block types', and
    the int8 planes'."""
    from marspec.backends.int8_planes import Int8PlanesLinear

    return [(kept.layer, kept.prefix) for kept in _block_types().values()] + [(Int8PlanesLinear, _PLANES)]


def _kept_types(form: str) -> tuple[object, ...]:
    """The GGUF block types ``form`` stores as they are: the target's form keeps Q4_K and Q6_K, the
    draft's Q4_K (its other layers are quantised to Q4_K), the int8 form none."""
    if form == "int8":
        return ()
    kept = tuple(_block_types())
    return kept if form == "q4k" else kept[:1]


def int8_model_file(folder: Path, form: str = "int8") -> Path:
    """Where ``folder``'s model of ``form`` (see the module) is stored: in a folder of its own, since
    loaders of a checkpoint (vLLM among them) take every ``*.safetensors`` at a folder's top level."""
    return folder / form / f"{form}.safetensors"


def load_int8_model(folder: Path, form: str = "int8") -> PreTrainedModel:
    """``folder``'s model of ``form`` ("int8", "q4k" or "q4k-draft", see the module) in eval mode, with
    attention one query row at a time (so a verification forward scores each token as a one-token
    forward does); written first if not stored yet."""
    path = int8_model_file(folder, form)
    model = _read(folder, path, form)
    if model is None:
        _write_once_found(folder, path, form)
        model = _read(folder, path, form)
        if model is None:
            raise MarspecError(f"the {form} model written to {path} cannot be read back; delete {folder}")
    return model


def _read(folder: Path, path: Path, form: str) -> PreTrainedModel | None:
    """The stored model, or None if there is none of this format (or it is damaged: written again)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as stored:
            if (stored.metadata() or {}).get("marspec_int8_format") != _FORMATS[form]:
                return None
            tensors = {name: stored.get_tensor(name) for name in stored.keys()}  # noqa: SIM118
    except (OSError, SafetensorError):
        return None
    model = empty_model(folder, torch.float32)
    try:
        _assemble(model, tensors)
    except (KeyError, RuntimeError) as exc:  # a layer or weight missing, or of another shape
        log.warning("marspec: the int8 model stored in %s does not fit (%s): writing it again", folder, exc)
        return None
    complete(model, folder)
    use_row_attention(model)
    model.requires_grad_(False)
    trim_heap()
    return model


def _assemble(model: PreTrainedModel, tensors: dict[str, torch.Tensor]) -> None:
    """Put the stored ``tensors`` into ``model`` (on the meta device): each linear layer as the file
    holds it (int8 rows, or Q4_K blocks), the rest assigned as they are."""
    embedding = name_of(model, model.get_input_embeddings())
    int8, scale = tensors.pop(f"{embedding}.{_INT8}"), tensors.pop(f"{embedding}.{_SCALE}")
    embed_scale = embedding_scale(model.get_input_embeddings())
    model.set_submodule(embedding, Int8Embedding(int8, scale, embed_scale=embed_scale))
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear:
            continue
        bias = tensors.pop(f"{name}.bias") if module.bias is not None else None
        if f"{name}.{_INT8}" in tensors:
            if not rowwise_int8_available():  # the int8 form, on a CPU without oneDNN's int8 path
                raise MarspecError(f"{name} is stored as int8 rows, and {INT8_UNAVAILABLE}")
            int8, scale = tensors.pop(f"{name}.{_INT8}"), tensors.pop(f"{name}.{_SCALE}")
            model.set_submodule(name, RowwiseInt8Linear(int8, scale, bias))
            release_pages(int8)  # copied into oneDNN's layout: the file's pages are not needed again
            continue
        for layer_type, layer_prefix in _stored_layers():
            prefix = f"{name}.{layer_prefix}"
            keys = [key for key in tensors if key.startswith(prefix)]
            held = {key[len(prefix) :]: tensors.pop(key) for key in keys}
            if held:
                model.set_submodule(name, layer_type(**held, bias=bias))
                break
        else:
            raise KeyError(f"{name}.{_INT8}")  # no form stored for this layer
    model.load_state_dict(tensors, strict=True, assign=True)


def _write_once_found(folder: Path, path: Path, form: str, attempts: int = 3) -> None:
    """:func:`_write`, again where the GGUF it found was gone before it was read: another process that
    stored its own form released it meanwhile (:func:`~marspec.models.convert.release_gguf`), and the
    next :func:`~marspec.models.convert.folder_gguf` assembles it again."""
    for attempt in range(attempts):
        try:
            _write(folder, path, form)
            return
        except FileNotFoundError as exc:
            if attempt == attempts - 1:
                raise MarspecError(
                    f"a file of {folder} ({exc.filename}) went missing while its {form} model was written; "
                    "load it again"
                ) from exc


def _write(folder: Path, path: Path, form: str) -> None:
    """Write ``folder``'s model of ``form`` to ``path`` from its GGUF or float32 weights (a temporary
    file renamed into place, so two processes writing at once need no lock)."""
    from marspec.models.gguf_weights import write_safetensors

    skeleton = empty_model(folder, torch.float32)
    path.parent.mkdir(exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    partial = Path(name)
    try:
        gguf = folder_gguf(folder, blocks_wanted=form != "int8")
        source = _source_tensors(folder, gguf, skeleton.config, form)
        stored = _stored_tensors(skeleton, source, _float_layers(form, gguf is not None))
        count = 3 * len(list(skeleton.parameters()))  # a weight becomes up to three tensors
        write_safetensors(partial, stored, count, {"marspec_int8_format": _FORMATS[form]})
        share_file(partial)
        os.replace(partial, path)
    except FileNotFoundError:
        raise  # the GGUF released by another process: written again (_write_once_found)
    except OSError as exc:
        raise MarspecError(
            f"writing the {form} model into {folder} failed ({exc.strerror or exc}); free disk space"
        ) from exc
    except (MemoryError, MarspecError):
        raise
    except Exception as exc:  # gguf and numpy raise assorted errors on damaged tensors
        raise MarspecError(f"cannot read the weights in {folder} ({one_line(exc)}); delete {folder}") from exc
    finally:
        partial.unlink(missing_ok=True)


def _float_layers(form: str, from_gguf: bool) -> str:
    """How ``form`` stores a linear layer that comes as float weights (dequantized where the GGUF's type is
    not kept): "q4k", Q4_K blocks (a draft's form, and the target's for a float checkpoint); "planes",
    int8 rows as the Q4_K kernel's planes (the target's form from a GGUF: its layers of another type keep
    their finer precision); "int8", int8 rows (the int8 engine's form)."""
    if form == "q4k-draft" or (form == "q4k" and not from_gguf):
        return "q4k"
    return "planes" if form == "q4k" else "int8"


def _source_tensors(
    folder: Path, gguf: Path | None, config: object, form: str
) -> Iterator[tuple[str, np.ndarray, object]]:
    """(name, array, GGUF type) for every weight of the model, from ``gguf`` or else the folder's float32
    file: for the Q4_K forms a GGUF's Q4_K tensors come as their raw blocks with their type, everything
    else as a float32 array with the type None."""
    if gguf is not None:
        from marspec.models.gguf_weights import gguf_tensors_keeping

        yield from gguf_tensors_keeping(gguf, config, _kept_types(form))
        return
    from safetensors import safe_open

    with safe_open(folder / WEIGHTS_FILE, framework="np") as weights:
        for name in weights.keys():  # noqa: SIM118
            yield name, weights.get_tensor(name).astype(np.float32, copy=False), None


def _stored_tensors(
    skeleton: PreTrainedModel, source: Iterator[tuple[str, np.ndarray, object]], float_layers: str
) -> Iterator[tuple[str, np.ndarray]]:
    """What the file holds for each tensor of ``source``: for the weights of linear layers (a tied LM
    head's from the embedding's weight) their blocks repacked where they come as raw blocks of a kept
    type, else as ``float_layers`` says (:func:`_float_layers`); int8 groups and scales
    for the token embedding; the float32 tensor for anything else."""
    linears = {name for name, m in skeleton.named_modules() if type(m) is torch.nn.Linear}
    embedding = name_of(skeleton, skeleton.get_input_embeddings())
    tied_head = name_of(skeleton, skeleton.get_output_embeddings()) if _is_tied(skeleton) else None
    for name, array, qtype in source:
        owner, _, leaf = name.rpartition(".")
        if owner == embedding and leaf == "weight":
            weight = _float_weight(array, qtype)
            yield from _int8_tensors(owner, int8_groups(weight))
            if tied_head is not None:
                yield from _layer_tensors(tied_head, array, qtype, float_layers, weight)
        elif owner in linears and leaf == "weight":
            yield from _layer_tensors(owner, array, qtype, float_layers)
        else:
            yield name, array
        del array
        trim_heap()  # the float32 tensor's pages go back before the next one is read


def _float_weight(array: np.ndarray, qtype: object) -> torch.Tensor:
    """A source array as a float32 tensor: raw blocks dequantized, a float array as it is."""
    if qtype is not None:
        return _block_types()[qtype].dequantize(array)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def _layer_tensors(
    owner: str, array: np.ndarray, qtype: object, float_layers: str, weight: torch.Tensor | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """A linear layer's stored tensors: its blocks repacked when ``array`` is raw blocks of a kept type;
    else, from its float weight (``weight``, when the caller has it already), as ``float_layers`` says
    (:func:`_float_layers`)."""
    from marspec.backends.int8_planes import Int8PlanesLinear
    from marspec.backends.q4k import Q4KLinear

    if qtype is not None:  # raw blocks: kept as they are
        prefix = _block_types()[qtype].prefix
        layer = _block_types()[qtype].layer.from_gguf_blocks(array)
    else:
        float_weight = weight if weight is not None else _float_weight(array, None)
        if float_layers == "int8":
            yield from _int8_tensors(owner, int8_rows(float_weight))
            return
        if float_layers == "planes":
            prefix, layer = _PLANES, Int8PlanesLinear.from_int8_rows(*int8_rows(float_weight))
        else:
            prefix, layer = _Q4K, Q4KLinear.from_float(float_weight)
    for key, tensor in layer.tensors.items():
        yield f"{owner}.{prefix}{key}", tensor.numpy()


def _int8_tensors(
    owner: str, quantised: tuple[torch.Tensor, torch.Tensor]
) -> Iterator[tuple[str, np.ndarray]]:
    int8, scale = quantised
    yield f"{owner}.{_INT8}", int8.numpy()
    yield f"{owner}.{_SCALE}", scale.numpy()


def _is_tied(model: PreTrainedModel) -> bool:
    return type(model.get_output_embeddings()) is torch.nn.Linear and bool(
        getattr(model.config, "tie_word_embeddings", False)
    )
