"""A converted folder's int8 model: written once from its GGUF (or its float32 weights) a tensor at a
time, then loaded from that file in seconds.

The file holds, for every linear layer, its int8 weights and per-row float32 scales, as the int8 kernel
takes them (:func:`~marspec.backends.int8.int8_rows`; a tied LM head's from the embedding's weight);
for the token embedding its int8 weights with a scale per group of channels
(:func:`~marspec.backends.int8.int8_groups`); everything else (norms, biases) in float32. Writing it
dequantizes one GGUF tensor at a time (the bytes the float32 conversion would write,
:func:`~marspec.models.gguf_weights.gguf_tensors`) and quantises it at once, so neither disk nor memory
ever holds the float32 model; a folder holding float32 weights instead is read the same way, into the
same model bit for bit.

Plain int8 and float32 arrays, so unlike the 4-bit store the file does not depend on the torch release
or the CPU that wrote it; oneDNN's blocked layout is made from it on load (:class:`RowwiseInt8Linear`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from marspec.backends.int8 import Int8Embedding, RowwiseInt8Linear, int8_groups, int8_rows
from marspec.backends.memory import release_pages, trim_heap
from marspec.backends.row_attention import use_row_attention
from marspec.errors import MarspecError, one_line
from marspec.models.cache import WEIGHTS_FILE, share_file
from marspec.models.convert import folder_gguf
from marspec.models.gguf_int4 import complete, empty_model, name_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger("marspec")

# Bumped when what the file holds changes; a file of another format is written again.
_FORMAT = "2"
_INT8, _SCALE = "int8_weight", "weight_scale"


def int8_model_file(folder: Path) -> Path:
    """Where ``folder``'s int8 model is stored: in a folder of its own, since loaders of a checkpoint
    (vLLM among them) take every ``*.safetensors`` at a folder's top level for its weights."""
    return folder / "int8" / "int8.safetensors"


def load_int8_model(folder: Path) -> PreTrainedModel:
    """``folder``'s int8 model in eval mode, with attention one query row at a time (so a verification
    forward scores each token as a one-token forward does); written first if not stored yet."""
    path = int8_model_file(folder)
    model = _read(folder, path)
    if model is None:
        _write(folder, path)
        model = _read(folder, path)
        if model is None:
            raise MarspecError(f"the int8 model written to {path} cannot be read back; delete {folder}")
    return model


def _read(folder: Path, path: Path) -> PreTrainedModel | None:
    """The stored model, or None if there is none of this format (or it is damaged: written again)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as stored:
            if (stored.metadata() or {}).get("marspec_int8_format") != _FORMAT:
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
    """Put the stored ``tensors`` into ``model`` (on the meta device): int8 layers where they were
    stored, the rest assigned as they are."""
    embedding = name_of(model, model.get_input_embeddings())
    int8, scale = tensors.pop(f"{embedding}.{_INT8}"), tensors.pop(f"{embedding}.{_SCALE}")
    model.set_submodule(embedding, Int8Embedding(int8, scale))
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear:
            continue
        int8, scale = tensors.pop(f"{name}.{_INT8}"), tensors.pop(f"{name}.{_SCALE}")
        bias = tensors.pop(f"{name}.bias") if module.bias is not None else None
        model.set_submodule(name, RowwiseInt8Linear(int8, scale, bias))
        release_pages(int8)  # copied into oneDNN's layout: the file's pages are not needed again
    model.load_state_dict(tensors, strict=True, assign=True)


def _write(folder: Path, path: Path) -> None:
    """Write ``folder``'s int8 model to ``path`` from its GGUF or float32 weights (a temporary file
    renamed into place, so two processes writing at once need no lock)."""
    from marspec.models.gguf_weights import write_safetensors

    skeleton = empty_model(folder, torch.float32)
    path.parent.mkdir(exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    partial = Path(name)
    try:
        stored = _stored_tensors(skeleton, _float_tensors(folder, skeleton.config))
        count = 2 * len(list(skeleton.parameters()))  # a weight becomes two tensors, int8 rows and scales
        write_safetensors(partial, stored, count, {"marspec_int8_format": _FORMAT})
        share_file(partial)
        os.replace(partial, path)
    except OSError as exc:
        raise MarspecError(
            f"writing the int8 model into {folder} failed ({exc.strerror or exc}); free disk space"
        ) from exc
    except (MemoryError, MarspecError):
        raise
    except Exception as exc:  # gguf and numpy raise assorted errors on damaged tensors
        raise MarspecError(f"cannot read the weights in {folder} ({one_line(exc)}); delete {folder}") from exc
    finally:
        partial.unlink(missing_ok=True)


def _float_tensors(folder: Path, config: object) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array) for every weight of the model, from the folder's GGUF or float32 file."""
    gguf = folder_gguf(folder)
    if gguf is not None:
        from marspec.models.gguf_weights import gguf_tensors

        yield from gguf_tensors(gguf, config)
        return
    from safetensors import safe_open

    with safe_open(folder / WEIGHTS_FILE, framework="np") as weights:
        for name in weights.keys():  # noqa: SIM118
            yield name, weights.get_tensor(name).astype(np.float32, copy=False)


def _stored_tensors(
    skeleton: PreTrainedModel, source: Iterator[tuple[str, np.ndarray]]
) -> Iterator[tuple[str, np.ndarray]]:
    """What the file holds for each float tensor of ``source``: int8 rows and scales for the weights of
    linear layers (a tied LM head's from the embedding's weight), int8 groups and scales for the token
    embedding, the float32 tensor for anything else."""
    linears = {name for name, m in skeleton.named_modules() if type(m) is torch.nn.Linear}
    embedding = name_of(skeleton, skeleton.get_input_embeddings())
    tied_head = name_of(skeleton, skeleton.get_output_embeddings()) if _is_tied(skeleton) else None
    for name, array in source:
        owner, _, leaf = name.rpartition(".")
        weight = torch.from_numpy(array if array.flags.writeable else array.copy())
        if owner == embedding and leaf == "weight":
            yield from _int8_tensors(owner, int8_groups(weight))
            if tied_head is not None:
                yield from _int8_tensors(tied_head, int8_rows(weight))
        elif owner in linears and leaf == "weight":
            yield from _int8_tensors(owner, int8_rows(weight))
        else:
            yield name, array
        del array, weight
        trim_heap()  # the float32 tensor's pages go back before the next one is read


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
