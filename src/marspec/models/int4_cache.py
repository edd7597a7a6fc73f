"""A converted folder's 4-bit model, stored beside its weights so that a later 4-bit load reads it back
instead of building it again.

Building a 4-bit model (from the GGUF, :mod:`marspec.models.gguf_int4`, or by quantising the float32
weights, :func:`~marspec.backends.int4.quantize_int4`) dequantizes and repacks every weight and, from a
GGUF, parses its header: ~100 s for the default pair on 2 cores (docs/models.md). What it builds is
written once to ``int4/<dtype>.safetensors`` in the folder (a draft's form, its token embedding in int8,
to ``int4/<dtype>-int8-embedding.safetensors``) and read back in seconds: in a folder of its own,
because vLLM, like other loaders of a checkpoint without an index, reads every ``*.safetensors`` at a
folder's top level as its weights (``vllm serve <folder>`` would fail on the 4-bit file). The packed
layout is ATen's, so a file is read back only by the torch release and CPU capability that wrote it (and this
module's format); any other rebuilds it and writes it again. A converted folder never changes its model
in place (a conversion renames a new folder into place), so the folder needs no other key.

A model read back views its file, memory-mapped as safetensors maps it: its pages are read on first use
and shared by every process that loads the same model. A file is only ever replaced by a rename, never
rewritten in place, so a model already loaded keeps the file it mapped.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from marspec.backends.int4 import GROUP_SIZE, Int4Linear
from marspec.backends.int8 import Int8Embedding
from marspec.models.cache import share_file

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger("marspec")

# Bumped when what the file holds changes; a file of another format is built again.
_FORMAT = "1"


def int4_model_file(folder: Path, dtype: torch.dtype, int8_embedding: bool = False) -> Path:
    """Where ``folder``'s 4-bit model with its other weights in ``dtype`` is stored (``int8_embedding``:
    its form with the token embedding in int8, a draft's)."""
    form = "-int8-embedding" if int8_embedding else ""
    return folder / "int4" / f"{_dtype_name(dtype)}{form}.safetensors"


def _top_level_file(folder: Path, dtype: torch.dtype) -> Path:
    """Where marspec stored it before it had a folder of its own: beside the weights, where vLLM takes it
    for a weights file, so it is removed once the model is stored in its place."""
    return folder / f"int4-{_dtype_name(dtype)}.safetensors"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _key() -> dict[str, str]:
    """What a stored model must have been written by to be read back here."""
    return {
        "marspec_int4_format": _FORMAT,
        "torch": str(torch.__version__),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "group_size": str(GROUP_SIZE),
    }


def _form_key(int8_embedding: bool) -> dict[str, str]:
    """:func:`_key`, and which form the file holds (the plain form's files of before still read)."""
    return _key() | {"embedding": "int8"} if int8_embedding else _key()


def read_int4_model(folder: Path, dtype: torch.dtype, int8_embedding: bool = False) -> PreTrainedModel | None:
    """``folder``'s stored 4-bit model (``int8_embedding``: the form with its token embedding in int8) in
    eval mode, or None if none was stored by this torch and CPU (or the file is damaged: the caller builds
    it again)."""
    from safetensors import SafetensorError, safe_open

    from marspec.models.gguf_int4 import complete, empty_model, name_of

    path = int4_model_file(folder, dtype, int8_embedding)
    try:
        with safe_open(path, framework="pt") as stored:
            if stored.metadata() != _form_key(int8_embedding):
                return None
            tensors = {name: stored.get_tensor(name) for name in stored.keys()}  # noqa: SIM118
    except (OSError, SafetensorError):
        return None
    model = empty_model(folder, dtype)
    try:
        if int8_embedding:
            name = name_of(model, model.get_input_embeddings())
            parts = {leaf: tensors.pop(f"{name}.{leaf}") for leaf in ("int8_weight", "weight_scale")}
            model.set_submodule(name, Int8Embedding(**parts, lookup_dtype=dtype))
        for name, module in list(model.named_modules()):
            if type(module) is torch.nn.Linear:
                leaves = ("packed_weight", "scale_and_zeros") + (("bias",) if module.bias is not None else ())
                parts = {leaf: tensors.pop(f"{name}.{leaf}") for leaf in leaves}
                model.set_submodule(name, Int4Linear.packed(module.in_features, module.out_features, **parts))
        model.load_state_dict(tensors, strict=True, assign=True)
    except (KeyError, RuntimeError) as exc:  # a layer or weight missing, or of another shape
        log.warning("marspec: the 4-bit model stored in %s does not fit (%s): building it again", folder, exc)
        return None
    complete(model, folder)
    return model


def write_int4_model(model: PreTrainedModel, folder: Path, dtype: torch.dtype) -> None:
    """Store ``model`` (its linear layers :class:`Int4Linear`, its token embedding float or
    :class:`Int8Embedding`, the rest in ``dtype``) in ``folder``. Best effort: a failed write (a full
    disk) is logged and leaves no file; the next load builds it again."""
    from safetensors.torch import save_file

    tensors = dict(model.state_dict())
    for name, module in model.named_modules():
        if isinstance(module, (Int4Linear, Int8Embedding)):
            tensors |= {f"{name}.{leaf}": tensor for leaf, tensor in module.tensors.items()}
    int8_embedding = isinstance(model.get_input_embeddings(), Int8Embedding)
    path = int4_model_file(folder, dtype, int8_embedding)
    partial = None
    try:
        path.parent.mkdir(exist_ok=True)
        # A file of its own, renamed into place: two loads storing at once need no lock.
        handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(handle)
        partial = Path(name)
        save_file(tensors, partial, metadata=_form_key(int8_embedding))
        share_file(partial)
        os.replace(partial, path)
        _top_level_file(folder, dtype).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("marspec: could not store the 4-bit model in %s (%s): built again next time", folder, exc)
    finally:
        if partial is not None:
            partial.unlink(missing_ok=True)
