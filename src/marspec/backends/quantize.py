"""Int8 linear layers: a cheaper draft, and a smaller, faster target that keeps strict == plain.

A draft only proposes; the target's verification decides every emitted token. So the draft may be
approximated freely: a wrong proposal costs acceptance, never correctness (and in sampling mode the
draft's probabilities are those of the quantised model, so losslessness holds for the model we run).
:func:`quantize_int8` uses torch's dynamic int8 layers (fbgemm), the fastest here for the draft's small
products, which scale each forward's activations as a whole.

That whole-forward scale makes a row's result depend on the other rows of its forward, so a target
quantised that way scores a token differently in a 13-token verification than in plain decoding's
one-token step, and strict verification no longer equals plain decoding (it broke on the 23rd token of
a small model). :func:`quantize_target_int8` gives each token row its own activation scale instead
(:class:`RowwiseInt8Linear`): the integer product is exact, so every row's output is the same bits
whatever else is in the forward. Its kernel is oneDNN's int8 product (VNNI or AMX on x86). Attention,
the one other place rows meet, is then computed row by row (:mod:`marspec.backends.row_attention`), so
a chain forward scores each token exactly as a one-token forward would, and strict verification of the
int8 target equals plain decoding of the same int8 target.

4-bit weights (``"int4"``, for the target or the draft) are :mod:`marspec.backends.int4`'s; this module
holds the choice between the precisions (:func:`check_target_quant`, :func:`quantize_target`,
:func:`quantize_draft`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantLinear
from transformers import PreTrainedModel

from marspec.backends.int4 import INT4_UNAVAILABLE, int4_available, quantize_int4
from marspec.backends.int8 import (
    INT8_UNAVAILABLE,
    RowwiseInt8Linear,
    rowwise_int8_available,
    use_int8_embedding,
)
from marspec.backends.kernels import kernels_available, unavailable_reason
from marspec.backends.memory import own_remaining_tensors, release_pages, trim_heap
from marspec.backends.q4k import Q4KLinear
from marspec.backends.row_attention import check_row_attention, use_row_attention
from marspec.defaults import DEFAULT_TARGET_QUANT
from marspec.errors import MarspecError

DRAFT_QUANTS = ("none", "int8", "int4", "q4k")
TARGET_QUANTS = ("none", "int8", "q4k", "int4")


def quantize_int8(model: PreTrainedModel) -> PreTrainedModel:
    """Replace every ``nn.Linear`` with an int8 dynamically quantised one (per-output-channel scales).

    On this CPU the 0.5B Qwen draft goes from ~126 to ~46 ms per token; its greedy choice agrees with the
    1.5B target on 91% of positions against 94.5% in fp32 (per-tensor scales: 88%). The activations are
    quantised at run time with one scale per forward (see the module's docstring for what that costs).
    """
    if next(model.parameters()).dtype != torch.float32:
        raise MarspecError("int8 draft quantisation needs the draft loaded in fp32 (use dtype='fp32')")
    with warnings.catch_warnings():
        # torch.ao's eager quantisation is deprecated in favour of torchao, which does not ship for this
        # torch build; the kernels (fbgemm) are the same ones and still present.
        warnings.simplefilter("ignore")
        # Layer by layer (what quantize_dynamic does, one swap at a time), giving back each fp32 weight's
        # pages as soon as its int8 copy exists (:mod:`marspec.backends.memory`).
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    child.qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
                    setattr(parent, name, DynamicQuantLinear.from_float(child))
                    release_pages(child.weight)
    own_remaining_tensors(model)
    return model


def quantize_target_int8(model: PreTrainedModel) -> PreTrainedModel:
    """Replace every ``nn.Linear`` of an fp32 model with a :class:`RowwiseInt8Linear`, in place.

    About a quarter of the linear weights' bytes; the token embedding becomes an :class:`Int8Embedding`
    (int8 with a scale per group of channels) and the norms stay fp32: the same model as the int8 engine
    stores for a GGUF (:mod:`marspec.models.int8_store`). The model's attention is switched to the
    row-by-row form (:func:`use_row_attention`).
    """
    if not rowwise_int8_available():
        raise MarspecError(INT8_UNAVAILABLE)
    return _quantize_target_rows(model, RowwiseInt8Linear.of)


def quantize_target_q4k(model: PreTrainedModel) -> PreTrainedModel:
    """:func:`quantize_target_int8`, except that every linear layer becomes a :class:`Q4KLinear`, its
    float weights quantised to Q4_K (:meth:`Q4KLinear.of`). A GGUF's Q4_K layers keep the file's own
    blocks instead (:mod:`marspec.models.int8_store`)."""
    check_target_quant("q4k", torch.float32)
    return _quantize_target_rows(model, Q4KLinear.of)


def _quantize_target_rows(
    model: PreTrainedModel, layer_of: Callable[[torch.nn.Linear], torch.nn.Module]
) -> PreTrainedModel:
    """Each ``nn.Linear`` of an fp32 model replaced by ``layer_of(linear)`` (a layer whose rows are
    computed alone), the embedding int8, attention row by row; in place."""
    if next(model.parameters()).dtype != torch.float32:
        raise MarspecError("int8 target quantisation needs the target loaded in fp32 (use dtype='fp32')")
    check_row_attention(model)
    use_row_attention(model)
    _replace_linears(model, layer_of)
    use_int8_embedding(model)  # after the layers: a tied head reads its weight
    own_remaining_tensors(model)
    trim_heap()
    return model


def _replace_linears(model: PreTrainedModel, layer_of: Callable[[torch.nn.Linear], torch.nn.Module]) -> None:
    """Each ``nn.Linear`` of ``model`` replaced by ``layer_of(linear)``, in place, its float weight's pages
    handed back at once."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, layer_of(child))
                release_pages(child.weight)
                trim_heap()


def check_target_quant(target_quant: str, dtype: torch.dtype) -> None:
    """Raise a one-line error unless a target loaded in ``dtype`` can be quantised to ``target_quant``
    here (before any weight is loaded). Where it runs (the CPU) and what was passed are the caller's."""
    if target_quant not in TARGET_QUANTS:
        choices = ", ".join((DEFAULT_TARGET_QUANT, *TARGET_QUANTS))
        raise MarspecError(f"unknown target_quant {target_quant!r}: choose one of {choices}")
    if target_quant in ("int8", "q4k") and dtype != torch.float32:
        raise MarspecError(f"target_quant={target_quant!r} quantises an fp32 target: use dtype='fp32'")
    if target_quant == "int8" and not rowwise_int8_available():
        raise MarspecError(INT8_UNAVAILABLE)
    if target_quant == "q4k" and not kernels_available():
        raise MarspecError(f"target_quant='q4k' is not available here: {unavailable_reason()}; use 'int8'")
    if target_quant == "int4":
        if dtype not in (torch.float32, torch.bfloat16):
            raise MarspecError("target_quant='int4' quantises an fp32 or bf16 target: use dtype='fp32'")
        if not int4_available():
            raise MarspecError(INT4_UNAVAILABLE)


def check_draft_quant(draft_quant: str) -> None:
    """Raise a one-line error unless ``draft_quant`` names a draft precision this build can run."""
    if draft_quant not in DRAFT_QUANTS:
        raise MarspecError(f"unknown draft_quant {draft_quant!r}: choose one of {', '.join(DRAFT_QUANTS)}")
    if draft_quant == "int4" and not int4_available():
        raise MarspecError(INT4_UNAVAILABLE)
    if draft_quant == "q4k" and not kernels_available():
        raise MarspecError(f"draft_quant='q4k' is not available here: {unavailable_reason()}; use 'int4'")


def quantize_target(model: PreTrainedModel, target_quant: str) -> PreTrainedModel:
    """Quantise a target's linear layers to ``target_quant`` ("int8", "q4k" or "int4"), in place, with
    attention one query row at a time: either way a verification forward scores each token as plain
    decoding's one-token step does, bit for bit. "q4k" quantises a float model's layers to Q4_K
    (:func:`quantize_target_q4k`); a GGUF's own Q4_K blocks come from :mod:`marspec.models.int8_store`."""
    if target_quant == "int8":
        return quantize_target_int8(model)
    if target_quant == "q4k":
        return quantize_target_q4k(model)
    check_row_attention(model)
    use_row_attention(model)
    return quantize_int4(model)


def quantize_draft(model: PreTrainedModel, draft_quant: str) -> PreTrainedModel:
    """Quantise a draft's linear layers to ``draft_quant`` ("int8" or "int4"), in place.

    A 4-bit draft's token embedding becomes int8 too (:func:`use_int8_embedding`: 0.15 GB for the 0.5B
    Qwen's against 0.54 GB in float32; a lookup is per row, so its rows stay computed alone). It also
    attends row by row (where its attention layers allow it): its rows are then
    computed alone, so sequences decoded together pack its draft steps into one forward and each still
    drafts what it would alone (:mod:`marspec.backends.packed`); a lossy rule's output follows the draft.
    The int8 draft's kernel scales a whole forward's activations at once, so its rows depend on each
    other whatever the attention: it is left as it is (sequences decoded together draft one at a time)."""
    if draft_quant == "int8":
        return quantize_int8(model)
    if draft_quant == "q4k":
        _replace_linears(model, Q4KLinear.of)
        own_remaining_tensors(model)
    else:
        quantize_int4(model)
    use_int8_embedding(model)
    with contextlib.suppress(MarspecError):  # other attention kinds: drafts still right, only not packed
        use_row_attention(model)
    return model
