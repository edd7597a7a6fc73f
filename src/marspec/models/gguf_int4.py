"""A model with 4-bit linear layers built straight from its GGUF, one tensor at a time, so that neither disk
nor memory ever holds the float32 model.

Each GGUF tensor is dequantized (:func:`~marspec.models.gguf_weights.gguf_tensors`, the bytes the float32
conversion writes) and, if it is a linear layer's weight, packed at once into an
:class:`~marspec.backends.int4.Int4Linear` by the same quantiser ``target_quant="int4"`` applies to a
loaded float model: the result is the same 4-bit model, bit for bit, as loading the converted float32
folder and quantising it, without the 7 GB file or the 7 GB of memory. Why not map the GGUF's own 4-bit
blocks into the kernel's layout: a packaged Q4_K_M file keeps some layers in Q6_K, Q5_0 or Q8_0, which
would need requantising anyway, and a second quantiser would make a second 4-bit model whose answers
are not the ones measured (docs/results.md, "4-bit weights").
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from marspec.backends.int4 import Int4Linear
from marspec.backends.memory import trim_heap
from marspec.errors import MarspecError
from marspec.models.gguf_weights import gguf_tensors

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def load_gguf_int4(gguf: Path, folder: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The causal LM of ``gguf`` (its configuration and generation settings in ``folder``) with every
    linear layer in 4 bits and the rest (embeddings, norms, biases) in ``dtype``, in eval mode.

    Equals ``quantize_int4`` applied to the float32 conversion loaded in ``dtype``: each weight is
    rounded to ``dtype`` before it is quantised, as loading in ``dtype`` rounds it. Memory: the model
    being built plus one float32 tensor.
    """
    model = empty_model(folder, dtype)
    config = model.config
    linears = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    pending: dict[str, dict[str, torch.Tensor]] = {}  # a linear's weight and bias, until both are read
    with torch.no_grad():
        for name, array in gguf_tensors(gguf, config):
            owner, _, leaf = name.rpartition(".")
            # A float32 GGUF tensor is a read-only view of the file: copied, as a parameter owns its data.
            tensor = torch.from_numpy(array if array.flags.writeable else array.copy()).to(dtype)
            if owner not in linears:
                model.get_submodule(owner).register_parameter(
                    leaf, torch.nn.Parameter(tensor, requires_grad=False)
                )
                continue
            parts = pending.setdefault(owner, {})
            parts[leaf] = tensor
            if "weight" in parts and (linears[owner].bias is None or "bias" in parts):
                model.set_submodule(owner, Int4Linear(parts["weight"], parts.get("bias")))
                del pending[owner]
                trim_heap()  # the float32 tensor's pages go back before the next one is read
        head = model.get_output_embeddings()
        if type(head) is torch.nn.Linear and getattr(config, "tie_word_embeddings", False):
            # A tied head reads the input embedding's weight: a 4-bit copy, the embedding keeps its own.
            model.set_submodule(name_of(model, head), Int4Linear(model.get_input_embeddings().weight))
    left = [n for n, p in model.named_parameters() if p.is_meta] + sorted(pending)
    if left:
        raise MarspecError(
            f"GGUF file {gguf} lacks {len(left)} weights the model needs (e.g. {left[0]}); delete {folder} "
            "and it will be prepared again"
        )
    complete(model, folder)
    trim_heap()
    return model


def empty_model(folder: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The causal LM of ``folder``'s configuration on the meta device, in ``dtype``: nothing allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def complete(model: PreTrainedModel, folder: Path) -> None:
    """Finish a model whose weights were filled in on the meta device: its computed buffers, ``folder``'s
    generation settings, eval mode."""
    from transformers import GenerationConfig

    _computed_buffers(model, model.config)
    model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    model.eval()


def name_of(model: torch.nn.Module, module: torch.nn.Module) -> str:
    """The name of ``module`` in ``model``."""
    return next(name for name, m in model.named_modules() if m is module)


def _computed_buffers(model: torch.nn.Module, config: object) -> None:
    """Build again, on the CPU, the modules whose buffers the meta device left empty: the rotary
    embeddings' frequencies, computed from the configuration rather than loaded."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            try:
                fresh = type(module)(config=config)
            except TypeError as exc:
                raise MarspecError(
                    f"cannot build {type(module).__name__} ({name}) of this architecture without its float "
                    "weights: load it without 4-bit weights (target_quant / draft_quant 'none' or 'int8')"
                ) from exc
            model.set_submodule(name, fresh)
