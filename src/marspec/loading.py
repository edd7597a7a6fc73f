"""Loading a pair: a target and its drafter, checked before any weight loads, then loaded.

:func:`load_pair` is what :class:`marspec.api.Decoder` does on construction: it settles the device, the
fixed-shape path and the precision (:mod:`marspec.precision`), refuses a bad setting, a misfit EAGLE-3 head
or a draft model with another tokenizer in one line before any weights load, then loads the target (and
quantises it), the drafter, and wraps both for the fixed-shape path; :class:`LoadedPair` is the result.
Kept apart from the API module so that the surface users read (``Decoder``'s arguments and methods) is
one file and how a pair comes to be is another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from marspec.backends.draft_head import first_added_id, narrow_first_head
from marspec.backends.fixed import FixedShapeLM, fixed_shape_lm, graphs_plan
from marspec.backends.hf import HFCausalLM, use_grouped_attention
from marspec.backends.prepack import prepack_linears
from marspec.backends.quantize import (
    check_draft_quant,
    check_target_quant,
    quantize_draft,
    quantize_target,
)
from marspec.backends.threads import in_passing_thread
from marspec.defaults import DEFAULT_DRAFT_CONFIDENCE
from marspec.devices import resolve_device
from marspec.drafters import Drafter, HybridDrafter, ModelDrafter, NgramDrafter
from marspec.drafters.eagle3 import Eagle3Drafter
from marspec.drafters.eagle3_fixed import FixedHeadCache
from marspec.drafters.eagle3_head import load_head
from marspec.errors import MarspecError
from marspec.load_settings import LoadSettings
from marspec.models import is_instruct, load_model, parse_dtype
from marspec.models.eagle3 import HeadSpec, TargetShape, check_fits, find_head, target_shape
from marspec.models.tokenizers import check_draft_tokenizer
from marspec.precision import choose_draft_quant, choose_precision

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CPU = torch.device("cpu")
# How one model is loaded (load_lm's signature); Decoder passes its module's, which tests replace.
LoadLM = Callable[..., tuple[HFCausalLM, bool]]


def load_lm(
    model: str | HFCausalLM,
    dtype: torch.dtype,
    prepack: bool = False,
    device: torch.device = CPU,
    int4_linears: bool = False,
    int8_linears: bool = False,
    int8_embedding: bool = False,
    tokenizer: PreTrainedTokenizerBase | None = None,
    q4k_form: str | None = None,
) -> tuple[HFCausalLM, bool]:
    """Load a model by name or path onto ``device`` (or take a loaded one, left as it is); return it and
    whether prompts default to chat. ``prepack`` holds the linear weights of a model loaded here in
    oneDNN's layout, and on the CPU its attention groups key/value heads under masks (both CPU kernel
    choices: not applied on another device). ``int4_linears``: its linear layers come back in 4 bits
    (:func:`~marspec.models.loading.load_model`: a known model builds them from its GGUF, or reads them
    back once stored), with ``int8_embedding`` its token embedding in int8 too (a draft's form).
    ``int8_linears``: a model of marspec's cache comes back as its stored int8 model
    (:mod:`marspec.models.int8_store`); another loads in ``dtype`` for the caller to quantise.
    ``q4k_form``: the same in the store's "q4k" or "q4k-draft" form (layers on the Q4_K kernel).
    ``tokenizer``: one already loaded to use instead of the model's own (a draft's: its target's)."""
    if isinstance(model, HFCausalLM):
        return model, bool(getattr(model.tokenizer, "chat_template", None))
    hf_model, tokenizer, spec = load_model(
        model,
        dtype=dtype,
        int4_linears=int4_linears,
        int8_linears=int8_linears,
        q4k_form=q4k_form,
        int8_embedding=int8_embedding,
        keep_gguf=False,  # the cache keeps what this form's later loads read
        tokenizer=tokenizer,
    )
    if device.type != "cpu":
        hf_model.to(device)
    else:
        use_grouped_attention(hf_model)  # a CPU kernel choice, like prepacking (see backends.hf)
        if prepack:
            prepack_linears(hf_model)
    return HFCausalLM(hf_model, tokenizer, model), is_instruct(spec, tokenizer)


def _check_target_quant(
    target_quant: str, target: str | HFCausalLM, dtype: torch.dtype, device: torch.device
) -> str:
    """``target_quant`` if the target can be quantised that way, else a one-line error saying why."""
    check_target_quant(target_quant, dtype)
    if target_quant == "none":
        return target_quant
    if device.type != "cpu":
        raise MarspecError(
            f"target_quant={target_quant!r} is a CPU kernel and the device is {device}: use "
            "device='cpu', or target_quant='none' (dtype='bf16' halves the target's memory on a GPU)"
        )
    if isinstance(target, HFCausalLM):
        raise MarspecError(
            f"target_quant={target_quant!r} applies to a target loaded by name or path; a model passed in "
            "loaded is used as it is: pass its name, or quantise it yourself "
            "(marspec.backends.quantize.quantize_target)"
        )
    return target_quant


def _target_shape(target: str | HFCausalLM) -> TargetShape:
    if isinstance(target, HFCausalLM):
        return TargetShape.of_config(target.name, target.model.config.to_dict())
    return target_shape(target)


def _eagle3_drafter(
    head: HeadSpec, layers: tuple[int, ...], target: HFCausalLM, confidence: float
) -> Eagle3Drafter:
    """An EAGLE-3 head (checked to fit already) loaded to draft for ``target``, in its dtype and device
    (the dtype its hidden states come in: a target passed in loaded keeps its own, whatever ``dtype``).
    On the fixed-shape path the head's steps take it too, captured where the target's forwards are."""
    embedding = target.model.get_input_embeddings()
    module = load_head(head, len(layers), embedding, target.dtype, target.device)
    cache = None
    if isinstance(target, FixedShapeLM):
        cache = FixedHeadCache(module, graphs=target.graphs is not None)
    return Eagle3Drafter(module, target, layers, head.name, min_confidence=confidence, cache=cache)


def _check_drafting(threads: object, draft_confidence: object, draft_quant: str, prepack: object) -> None:
    """A one-line error for a bad thread count, confidence stop, draft precision or prepack flag."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise MarspecError(f"threads must be an integer >= 1, got {threads!r}")
    if draft_confidence is not None and not (
        isinstance(draft_confidence, (int, float)) and 0.0 <= draft_confidence <= 1.0
    ):
        raise MarspecError(
            f"draft_confidence must be a number in [0, 1] (or None: chosen), got {draft_confidence!r}"
        )
    check_draft_quant(draft_quant)
    if not isinstance(prepack, bool):
        raise MarspecError(f"prepack must be true or false, got {prepack!r}")


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def check_same_tokenizer(target: str | HFCausalLM, draft: str | HFCausalLM) -> None:
    """A draft model is only usable if its token ids mean what the target's mean; checked on the
    tokenizers alone, before any weights load (a model passed in loaded brings its own). An EAGLE-3
    head has no tokenizer: it drafts in the target's ids, and :func:`check_fits` checks its maps."""
    if isinstance(draft, str) and find_head(draft) is not None:
        return

    def source(model: str | HFCausalLM) -> tuple[Any, str]:
        return (model.tokenizer, model.name) if isinstance(model, HFCausalLM) else (model, str(model))

    (target_tokenizer, target_name), (draft_tokenizer, draft_name) = source(target), source(draft)
    check_draft_tokenizer(target_tokenizer, draft_tokenizer, target_name, draft_name)


@dataclass
class LoadedPair:
    """A loaded target and drafter, with what was chosen for them."""

    device: torch.device
    fixed_shape: bool  # the fixed-shape path (backends.fixed)
    captured: bool  # its forwards captured as CUDA graphs
    target_quant: str  # "none", "int8", "int4" or "q4k"
    target: HFCausalLM | FixedShapeLM
    chat_default: bool  # prompts default to the chat template
    drafter: Drafter | None
    draft_name: str | None  # as a calibration knows it (marspec.calibration); None without a drafter
    draft_weights: str | None  # in words: None without a drafter, "none" for n-gram lookup
    target_weights: str  # in words (the demo's and the bench's tables name them)
    hint: str | None  # a precision hint to log once the pair has loaded (marspec.precision)


def load_pair(
    target: str | HFCausalLM,
    draft: str | HFCausalLM | None,
    dtype: str | torch.dtype,
    threads: int | None,
    settings: LoadSettings,
    load: LoadLM | None = None,
) -> LoadedPair:
    """Check every setting (and an EAGLE-3 head or a draft model's tokenizer against the target) before
    any weights load, then load the pair (:class:`marspec.api.Decoder`'s arguments say what each does).
    ``load`` loads one model (default :func:`load_lm`). Loading runs in a thread that ends with it, so
    that decoding, in this thread or another (a server's), holds the process's only OpenMP team
    (:mod:`marspec.backends.threads` says why)."""
    device = resolve_device(settings.device)
    fixed_shape, captured = graphs_plan(settings.graphs, device)
    draft_quant = choose_draft_quant(settings.draft_quant, device)
    _check_drafting(threads, settings.draft_confidence, draft_quant, settings.prepack)
    if threads is not None:
        torch.set_num_threads(threads)
    precision = choose_precision(target, settings.target_quant, dtype, device)
    torch_dtype = parse_dtype(precision.dtype)
    target_quant = _check_target_quant(precision.target_quant, target, torch_dtype, device)
    head = find_head(draft) if isinstance(draft, str) else None
    head_layers = check_fits(head, _target_shape(target)) if head is not None else ()
    if head is None and draft is not None and draft not in ("none", "ngram"):
        check_same_tokenizer(target, draft)
    loader = load or load_lm
    plan = _Plan(device, fixed_shape, captured, target_quant, torch_dtype, draft_quant, settings, loader)
    loaded = in_passing_thread(lambda: plan.load(target, draft, head, head_layers))
    loaded.hint = precision.hint
    return loaded


@dataclass(frozen=True)
class _Plan:
    """What :func:`load_pair` settled, for loading in its thread."""

    device: torch.device
    fixed_shape: bool
    captured: bool
    target_quant: str
    dtype: torch.dtype
    draft_quant: str
    settings: LoadSettings
    loader: LoadLM

    @property
    def confidence(self) -> float:
        """The drafter's confidence stop until one is chosen from the machine's costs (after the load)."""
        named = self.settings.draft_confidence
        return DEFAULT_DRAFT_CONFIDENCE if named is None else named

    def load(
        self,
        target: str | HFCausalLM,
        draft: str | HFCausalLM | None,
        head: HeadSpec | None,
        head_layers: tuple[int, ...],
    ) -> LoadedPair:
        """Load the target and the drafter (the weights :func:`load_pair` has checked)."""
        quantized_target = self.target_quant != "none"
        target_lm, chat_default = self.loader(
            target,
            self.dtype,
            self.settings.prepack and not quantized_target,
            self.device,
            int4_linears=self.target_quant == "int4",
            int8_linears=self.target_quant == "int8",
            q4k_form="q4k" if self.target_quant == "q4k" else None,
        )
        if quantized_target:
            quantize_target(target_lm.model, self.target_quant)
        target_weights = self.target_quant if quantized_target else _dtype_name(target_lm.dtype)
        loaded_target: HFCausalLM | FixedShapeLM = target_lm
        if self.fixed_shape:
            loaded_target = fixed_shape_lm(target_lm, self.captured)
        pair = LoadedPair(
            device=self.device,
            fixed_shape=self.fixed_shape,
            captured=self.captured,
            target_quant=self.target_quant,
            target=loaded_target,
            chat_default=chat_default,
            drafter=None,
            draft_name=None,
            draft_weights=None,
            target_weights=target_weights,
            hint=None,
        )
        confidence, lookup = self.confidence, self.settings.lookup
        if draft is None or draft == "none":
            pass
        elif draft == "ngram":
            pair.drafter = NgramDrafter()
            pair.draft_name, pair.draft_weights = "ngram", "none"
        elif head is not None:
            pair.draft_name, pair.draft_weights = head.name, _dtype_name(loaded_target.dtype)
            head_drafter = _eagle3_drafter(head, head_layers, loaded_target, confidence)
            pair.drafter = HybridDrafter(head_drafter) if lookup else head_drafter
        else:
            model_drafter = self._model_drafter(draft, loaded_target, pair)
            pair.drafter = HybridDrafter(model_drafter) if lookup else model_drafter
        return pair

    def _model_drafter(
        self, draft: str | HFCausalLM, target: HFCausalLM | FixedShapeLM, pair: LoadedPair
    ) -> ModelDrafter:
        """A draft model loaded (or taken as passed in) to draft for the loaded ``target``; sets
        ``pair``'s draft name and weights."""
        draft_quant = self.draft_quant
        # int8 and int4 are CPU kernels: elsewhere the draft runs in the target's dtype.
        quantize = self.device.type == "cpu" and draft_quant != "none" and not isinstance(draft, HFCausalLM)
        # int8 kernels take fp32 activations; int4 ones bf16, so an int4 draft keeps the target's
        # dtype (its embedding is int8 either way). The draft's dtype does not bear on exactness anyway.
        draft_dtype = torch.float32 if quantize and draft_quant in ("int8", "q4k") else self.dtype
        draft_lm, _ = self.loader(
            draft,
            draft_dtype,
            self.settings.prepack and not quantize,
            self.device,
            int4_linears=quantize and draft_quant == "int4",
            int8_linears=quantize and draft_quant == "int8",
            int8_embedding=quantize and draft_quant == "int4",  # what quantize_draft makes of it
            q4k_form="q4k-draft" if quantize and draft_quant == "q4k" else None,
            # Checked to be the target's (check_same_tokenizer): one tokenizer in memory, not two.
            tokenizer=target.tokenizer,
        )
        if quantize:
            quantize_draft(draft_lm.model, draft_quant)
            if draft_quant == "q4k":
                narrow_first_head(draft_lm.model, first_added_id(target.tokenizer))
        pair.draft_name = draft_lm.name
        pair.draft_weights = draft_quant if quantize else _dtype_name(draft_lm.dtype)
        if self.fixed_shape:
            draft_lm = fixed_shape_lm(draft_lm, self.captured)
        return ModelDrafter(draft_lm, target.vocab_size, min_confidence=self.confidence)
