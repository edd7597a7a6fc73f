"""The public API: ``Decoder`` keeps models loaded between calls; ``generate`` is the one-call form.

The surface users import (``Decoder``, ``GenerationOptions``, ``GenerationResult``, ``GenerationStream``,
``generate``), kept in one place to be read as one. The work is elsewhere: the loop in ``decode.py``,
settling a generation's options in ``settings.py`` (where ``GenerationOptions`` lives), models in
``models/`` and ``backends/``, the precision chosen in ``precision.py``.

Why it is over 450 lines: a third of it is ``Decoder``'s documentation of every argument, which users
read here (``help(marspec.Decoder)``); the rest is the checks made before any weight loads, the assembly
of a pair from its parts, each a short function, kept beside the one class that uses them, and the
generation entry points users call on it (one sequence here; several delegate to ``marspec.batch``).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import torch

from marspec.backends.direct import fallback_note
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
from marspec.batch.many import BatchStream, decode_many
from marspec.batch.slots import Slot
from marspec.decode import DecodeConfig, decode
from marspec.defaults import DEFAULT_DTYPE
from marspec.detok import IncrementalDetokenizer
from marspec.devices import resolve_device
from marspec.drafters import Drafter, HybridDrafter, ModelDrafter, NgramDrafter
from marspec.drafters.eagle3 import Eagle3Drafter
from marspec.drafters.eagle3_fixed import FixedHeadCache
from marspec.drafters.eagle3_head import load_head
from marspec.errors import MarspecError
from marspec.load_settings import LoadSettings
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET, is_instruct, load_model, parse_dtype
from marspec.models.eagle3 import HeadSpec, TargetShape, check_fits, find_head, target_shape
from marspec.models.tokenizers import check_draft_tokenizer
from marspec.precision import choose_draft_quant, choose_precision
from marspec.prompting import Prompt, encode_prompt
from marspec.settings import GenerationOptions, Pair, settle, stop_strings
from marspec.stats import GenerationStats

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("marspec")

CPU = torch.device("cpu")
FinishReason = Literal["eos", "length", "stop"]


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability under the target (at temperature 1, from the verification
    forward that emitted it) and the target's most likely tokens there, ``(token id, log probability)``
    most likely first (as many as the ``logprobs`` option asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": [list(t) for t in self.top]}


@dataclass
class GenerationResult:
    """What one generation produced.

    ``relaxed_positions`` are indices into ``token_ids`` of the tokens accepted by relaxation (the
    places where the output may differ from strict verification); ``relaxed_top1`` holds, for each, the
    token strict would have taken there (the target's top-1), and ``relaxed_margins`` the rule's margin.
    ``logprobs`` (with the ``logprobs`` option, else None) is aligned with ``token_ids``.
    """

    text: str
    token_ids: list[int]
    relaxed_positions: list[int]
    finish_reason: FinishReason
    stats: GenerationStats = field(repr=False)
    relaxed_top1: list[int] = field(default_factory=list)
    relaxed_margins: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None

    def to_dict(self, with_steps: bool = False) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "relaxed_positions": self.relaxed_positions,
            "relaxed_top1": self.relaxed_top1,
            "relaxed_margins": self.relaxed_margins,
            "finish_reason": self.finish_reason,
            "logprobs": None if self.logprobs is None else [t.to_dict() for t in self.logprobs],
            "stats": self.stats.to_dict(with_steps=with_steps),
        }


class GenerationStream:
    """Iterate to receive text deltas as they are decoded; ``result`` is set once iteration ends.

    ``logprobs`` (with the ``logprobs`` option) grows as tokens are decoded: when a delta arrives it
    holds every token decoded so far, those whose text a later delta completes included."""

    def __init__(
        self, gen: Generator[str, None, GenerationResult], logprobs: list[TokenLogprob] | None = None
    ) -> None:
        self._gen = gen
        self.result: GenerationResult | None = None
        self.logprobs: list[TokenLogprob] = [] if logprobs is None else logprobs

    def __iter__(self) -> Iterator[str]:
        self.result = yield from self._gen

    def close(self) -> None:
        """Stop generating early (for example when the client went away)."""
        self._gen.close()


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
    if not (isinstance(draft_confidence, (int, float)) and 0.0 <= draft_confidence <= 1.0):
        raise MarspecError(f"draft_confidence must be a number in [0, 1], got {draft_confidence!r}")
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


class Decoder:
    """A target model, optionally a drafter, loaded once and reused across generations.

    Args:
        target: a known model name (see ``marspec models``), a local HF model folder, a .gguf file or a
            Hugging Face Hub id ``ORG/NAME`` (from the HF cache, downloaded when online; docs/models.md).
        draft: a draft model (same forms; must share the target's tokenizer), an EAGLE-3 head for the
            target (a folder or Hub id of a head in the published format, recognised by its config's
            ``LlamaForCausalLMEagle3``: it drafts from the target's hidden states; docs/models.md),
            ``"ngram"`` for prompt lookup, or ``None`` for plain decoding only.
        dtype: ``"auto"`` (default: see ``target_quant``), ``"fp32"`` (exact) or ``"bf16"``. Naming a
            dtype names the target's precision: with ``target_quant="auto"`` it stays a float model.
        threads: torch intra-op threads (default: torch's choice). This is ``torch.set_num_threads``,
            which is process-wide: it also changes the thread count of every other torch user in the
            process (and of Decoders created earlier), and stays set after this Decoder is gone.
        draft_quant: ``"auto"`` (default): on a CPU ``"q4k"`` where the Q4_K kernel runs, else ``"int4"``;
            elsewhere ``"none"`` (:func:`marspec.precision.choose_draft_quant`). ``"q4k"`` runs every linear
            layer of a draft loaded by name on the Q4_K kernel (the cheapest one-token step on a CPU: the
            0.5B Qwen's costs ~0.4 of the q4k target's), ``"int4"`` 4-bit weights in groups of 32 on
            torch's kernel, ``"int8"`` int8 linear layers, ``"none"`` its own weights. CPU kernels: on
            another device the draft runs in the target's dtype. A draft only proposes, so this never
            touches exactness. An EAGLE-3 head runs in the target's dtype whatever this says.
        draft_confidence: a drafted token whose draft probability is below this ends the draft early
            (0 always drafts ``k`` tokens; then ``k`` is a fixed length rather than a maximum).
        lookup: with a draft model, first try prompt lookup (copy a continuation from the context when
            its last tokens recur there) and ask the model only when there is no match.
        prepack: hold the linear weights of models loaded here (the target, and a draft not quantised to
            int8) in oneDNN's blocked layout: multi-token forwards, which verification is made of, cost
            about 3x less on CPU (see :mod:`marspec.backends.prepack`). Models passed in loaded are left
            as they are.
        device: ``"auto"`` (a CUDA GPU, else Apple MPS, else the CPU), ``"cpu"``, ``"cuda"``,
            ``"cuda:N"`` or ``"mps"``: where the models, caches and verification run. ``draft_quant`` and
            ``prepack`` are CPU kernel choices and apply on the CPU only. Only the CPU has been tested
            by this project (see the README).
        target_quant: ``"auto"`` (default, with ``dtype="auto"``): on a CPU with an int8 dot product, a
            model that comes as a GGUF (a known name or a ``.gguf`` path) runs as ``"q4k"`` where the Q4_K
            kernel runs (x86-64 Linux, AVX-512 VNNI, a C++ compiler), else as ``"int8"``, built straight
            from the GGUF and stored in marspec's cache; anything else as ``"none"`` in fp32, with a hint
            naming the fast engine for a float checkpoint (:mod:`marspec.precision`). ``"q4k"`` keeps the
            GGUF's own Q4_K and Q6_K blocks for marspec's AVX-512 VNNI kernels (int8 activation rows, each
            row's sums in one fixed order), its other layers in int8 rows as ``"int8"``: strict equals
            plain decoding of that model. ``"int8"`` runs the
            target's linear layers, LM head and embedding in int8, one activation scale per token row
            (oneDNN, CPU only): a verification forward costs about one one-token step, and the model is a
            different one from the fp32 model (its answers can differ), while strict verification still
            equals plain decoding of that int8 target. ``"int4"``: 4-bit weights in groups of 32 with bf16
            activations (ATen's int4 CPU kernel): about a sixth of fp32's weight bytes, a one-token step
            near int8's, but a verification forward costing several steps; strict equals plain decoding of
            that int4 target. ``"none"`` keeps the target as loaded (``target_quant="none"`` alone gives the
            exact fp32 model).
        graphs: ``"auto"`` (default), ``"on"`` or ``"off"``: the fixed-shape path
            (:mod:`marspec.backends.fixed`: a KV cache of fixed capacity, forwards padded to a few sizes,
            masks built on the device), whose forwards a CUDA device captures once per shape as CUDA
            graphs and replays. ``"on"`` takes it on every device (on a CPU or MPS uncaptured, the same
            tokens); ``"off"`` is the eager path; ``"auto"`` captures on CUDA and is eager elsewhere
            (uncaptured on a CPU, strict decoding measured ~12% slower and plain the same: docs/results.md,
            "Fixed shapes on the CPU"). Every drafter (EAGLE-3 heads included) and the int8/int4 targets
            run on it.
            Greedy output is the same token for token either way (tested).
    """

    def __init__(
        self,
        target: str | HFCausalLM = DEFAULT_TARGET,
        draft: str | HFCausalLM | None = DEFAULT_DRAFT,
        *,
        dtype: str | torch.dtype = DEFAULT_DTYPE,
        threads: int | None = None,
        draft_quant: str = LoadSettings.draft_quant,
        draft_confidence: float = LoadSettings.draft_confidence,
        lookup: bool = LoadSettings.lookup,
        prepack: bool = LoadSettings.prepack,
        device: str | torch.device = LoadSettings.device,
        target_quant: str = LoadSettings.target_quant,
        graphs: str = LoadSettings.graphs,
    ) -> None:
        self.device = resolve_device(device)
        # (the fixed-shape path, captured as CUDA graphs), checked before any weight is loaded.
        self.fixed_shape, self.captured = graphs_plan(graphs, self.device)
        draft_quant = choose_draft_quant(draft_quant, self.device)
        _check_drafting(threads, draft_confidence, draft_quant, prepack)
        if threads is not None:
            torch.set_num_threads(threads)
        precision = choose_precision(target, target_quant, dtype, self.device)
        torch_dtype = parse_dtype(precision.dtype)
        self.target_quant = _check_target_quant(precision.target_quant, target, torch_dtype, self.device)
        quantized_target = self.target_quant != "none"
        # An EAGLE-3 head is checked against the target's config, and a draft model's tokenizer against
        # the target's, before any weights load.
        head = find_head(draft) if isinstance(draft, str) else None
        head_layers = check_fits(head, _target_shape(target)) if head is not None else ()
        if head is None and draft is not None and draft not in ("none", "ngram"):
            check_same_tokenizer(target, draft)
        # Loading runs in a thread that ends with it, so that decoding, in this thread or another (a
        # server's), holds the process's only OpenMP team (marspec.backends.threads says why).
        in_passing_thread(
            lambda: self._load(
                target,
                draft,
                torch_dtype,
                head,
                head_layers,
                draft_quant=draft_quant,
                draft_confidence=draft_confidence,
                lookup=lookup,
                prepack=prepack,
            )
        )
        # The weights each model runs with, in words (the demo's and the bench's tables name them).
        self.target_weights = self.target_quant if quantized_target else _dtype_name(self.target.dtype)
        self.eos_token_ids = self.target.eos_token_ids
        # What settling a generation needs of this pair (marspec.settings.settle).
        self.pair = Pair(
            target=self.target.name,
            draft=self.draft_name,
            eos_token_ids=self.eos_token_ids,
            target_quant=self.target_quant,
            tokenizer=self.tokenizer,
            vocab_size=self.target.vocab_size,
            device=self.target.device,
        )
        if precision.hint is not None:  # once the pair has loaded, so that an error comes alone
            log.warning(precision.hint)
        if quantized_target and isinstance(self.target, HFCausalLM):
            note = fallback_note(self.target.model, self.target.name, self.target_quant)
            if note is not None:
                log.warning(note)

    def _load(
        self,
        target: str | HFCausalLM,
        draft: str | HFCausalLM | None,
        torch_dtype: torch.dtype,
        head: HeadSpec | None,
        head_layers: tuple[int, ...],
        *,
        draft_quant: str,
        draft_confidence: float,
        lookup: bool,
        prepack: bool,
    ) -> None:
        """Load the target and the drafter (the weights :meth:`__init__` has checked)."""
        quantized_target = self.target_quant != "none"
        self.target, self.chat_default = load_lm(
            target,
            torch_dtype,
            prepack and not quantized_target,
            self.device,
            int4_linears=self.target_quant == "int4",
            int8_linears=self.target_quant == "int8",
            q4k_form="q4k" if self.target_quant == "q4k" else None,
        )
        if quantized_target:
            quantize_target(self.target.model, self.target_quant)
        if self.fixed_shape:
            self.target = fixed_shape_lm(self.target, self.captured)
        self.drafter: Drafter | None = None
        # The drafter's weights in words: None without one, "none" for n-gram lookup.
        self.draft_weights: str | None = None
        # The drafter's name as a calibration knows it (see marspec.calibration); None without one.
        self.draft_name: str | None = None
        if draft is None or draft == "none":
            pass
        elif draft == "ngram":
            self.drafter = NgramDrafter()
            self.draft_name, self.draft_weights = "ngram", "none"
        elif head is not None:
            self.draft_name, self.draft_weights = head.name, _dtype_name(self.target.dtype)
            head_drafter = _eagle3_drafter(head, head_layers, self.target, draft_confidence)
            self.drafter = HybridDrafter(head_drafter) if lookup else head_drafter
        else:
            model_drafter = self._model_drafter(draft, draft_quant, torch_dtype, prepack, draft_confidence)
            self.drafter = HybridDrafter(model_drafter) if lookup else model_drafter

    def _model_drafter(
        self,
        draft: str | HFCausalLM,
        draft_quant: str,
        dtype: torch.dtype,
        prepack: bool,
        confidence: float,
    ) -> ModelDrafter:
        """A draft model loaded (or taken as passed in) to draft for the loaded target; sets
        :attr:`draft_name` and :attr:`draft_weights`."""
        # int8 and int4 are CPU kernels: elsewhere the draft runs in the target's dtype.
        quantize = self.device.type == "cpu" and draft_quant != "none" and not isinstance(draft, HFCausalLM)
        # int8 kernels take fp32 activations; int4 ones bf16, so an int4 draft keeps the target's
        # dtype (its embedding is int8 either way). The draft's dtype does not bear on exactness anyway.
        draft_dtype = torch.float32 if quantize and draft_quant in ("int8", "q4k") else dtype
        draft_lm, _ = load_lm(
            draft,
            draft_dtype,
            prepack and not quantize,
            self.device,
            int4_linears=quantize and draft_quant == "int4",
            int8_linears=quantize and draft_quant == "int8",
            int8_embedding=quantize and draft_quant == "int4",  # what quantize_draft makes of it
            q4k_form="q4k-draft" if quantize and draft_quant == "q4k" else None,
            # Checked to be the target's (check_same_tokenizer): one tokenizer in memory, not two.
            tokenizer=self.tokenizer,
        )
        if quantize:
            quantize_draft(draft_lm.model, draft_quant)
        self.draft_name = draft_lm.name
        self.draft_weights = draft_quant if quantize else _dtype_name(draft_lm.dtype)
        if self.fixed_shape:
            draft_lm = fixed_shape_lm(draft_lm, self.captured)
        return ModelDrafter(draft_lm, self.target.vocab_size, min_confidence=confidence)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def settle(self, opts: GenerationOptions) -> DecodeConfig:
        """What ``opts`` decode with on this pair (:func:`marspec.settings.settle`): ``theta="auto"``
        read from the pair's calibration, unset settings filled, the class guard's table built."""
        return settle(opts, self.pair)

    def resolve_theta(self, opts: GenerationOptions) -> GenerationOptions:
        """``opts`` naming the margin and theta :meth:`settle` decodes them with (``theta="auto"``
        resolved, unset ones filled), for echoing to a caller; the values are settle's."""
        rule = self.settle(opts).rule
        return replace(opts, theta=rule.theta, margin=rule.margin)

    def generate(
        self, prompt: Prompt, *, on_text: Callable[[str], None] | None = None, **options: Any
    ) -> GenerationResult:
        """Generate a continuation of ``prompt`` (text, or chat messages ``[{"role", "content"}]``).

        ``options`` are the fields of :class:`GenerationOptions` (rule, theta, margin, k, temperature,
        seed, max_new_tokens, stop, chat). ``on_text`` receives text deltas as they are decoded.
        """
        opts = GenerationOptions.of(options)
        gen = self._generate(prompt, opts, stream=on_text is not None, logprobs=[])
        while True:
            try:
                delta = next(gen)
            except StopIteration as done:
                return done.value
            if on_text is not None:
                on_text(delta)

    def stream(self, prompt: Prompt, **options: Any) -> GenerationStream:
        """Like ``generate`` but returns an iterator of text deltas; see ``GenerationStream``."""
        logprobs: list[TokenLogprob] = []
        opts = GenerationOptions.of(options)
        return GenerationStream(self._generate(prompt, opts, stream=True, logprobs=logprobs), logprobs)

    def generate_many(
        self,
        prompts: Sequence[Prompt],
        *,
        max_batch: int | None = None,
        per_prompt: Sequence[Mapping[str, Any]] | None = None,
        **options: Any,
    ) -> list[GenerationResult]:
        """Generate continuations of several prompts decoded together; one result per prompt, in order.

        Up to ``max_batch`` sequences (default: :func:`marspec.batch.many.default_max_batch`) share each
        model forward; the rest start as others finish. ``options`` are :class:`GenerationOptions` fields
        for every prompt; ``per_prompt`` (one mapping per prompt) overrides them for one (its rule, k,
        temperature, seed, stops, ...). On the CPU engines (int8, int4) each result is the one
        :meth:`generate` gives for that prompt alone, token for token (greedy, or sampling with a seed).
        """
        gen = decode_many(self, prompts, max_batch=max_batch, per_prompt=per_prompt, stream=False, **options)
        while True:
            try:
                next(gen)
            except StopIteration as done:
                return done.value

    def stream_many(
        self,
        prompts: Sequence[Prompt],
        *,
        max_batch: int | None = None,
        per_prompt: Sequence[Mapping[str, Any]] | None = None,
        **options: Any,
    ) -> BatchStream:
        """Like :meth:`generate_many`, but an iterator of ``(prompt index, text delta)`` pairs in the order
        they are decoded; see :class:`~marspec.batch.many.BatchStream`."""
        return BatchStream(
            decode_many(self, prompts, max_batch=max_batch, per_prompt=per_prompt, stream=True, **options)
        )

    def prompt_ids(self, prompt: Prompt, opts: GenerationOptions) -> torch.Tensor:
        """``prompt`` as the target's token ids (long[L], on its device), in the chat form ``opts`` asks
        for; raises a one-line error when it leaves no room in the target's context."""
        chat = self.chat_default if opts.chat is None else opts.chat
        prompt_ids = encode_prompt(self.tokenizer, prompt, chat, self.target.name).to(self.target.device)
        ctx = self.target.context_length
        if ctx and prompt_ids.shape[0] >= ctx:
            raise MarspecError(
                f"prompt is {prompt_ids.shape[0]} tokens but {self.target.name!r} has a context of {ctx}: "
                "shorten the prompt"
            )
        return prompt_ids

    def decode_on(
        self,
        slot: Slot,
        prompt: Prompt,
        opts: GenerationOptions,
        stream: bool,
        logprobs: list[TokenLogprob] | None = None,
    ) -> Generator[str, None, GenerationResult]:
        """:meth:`stream`'s generation on a batch's slot (:mod:`marspec.batch`): its caches, its drafter;
        ``logprobs`` as :meth:`_generate` fills it."""
        return self._generate(prompt, opts, stream, [] if logprobs is None else logprobs, slot)

    def _generate(
        self,
        prompt: Prompt,
        opts: GenerationOptions,
        stream: bool,
        logprobs: list[TokenLogprob],
        slot: Slot | None = None,
    ) -> Generator[str, None, GenerationResult]:
        """The generation as text deltas (when ``stream`` or stop strings ask for them), on ``slot`` when
        given (else the pair's own caches); its tokens' log probabilities, with the ``logprobs`` option,
        are appended to ``logprobs`` as they are decoded."""
        config = self.settle(opts)
        target = self.target if slot is None else slot.target
        drafter = None if opts.rule == "plain" else self.drafter if slot is None else slot.drafter
        stops = stop_strings(opts.stop)
        prompt_ids = self.prompt_ids(prompt, opts)
        # Without a seed, draw one from the OS: torch.seed() would also reseed torch's global generator.
        seed = opts.seed if opts.seed is not None else secrets.randbits(63)
        generator = torch.Generator(device=self.target.device).manual_seed(seed)

        stats = GenerationStats()
        token_ids: list[int] = []
        relaxed_positions: list[int] = []
        relaxed_top1: list[int] = []
        relaxed_margins: list[float] = []
        detok = IncrementalDetokenizer(self.tokenizer) if (stream or stops) else None
        finish: FinishReason = "length"
        start = time.perf_counter()
        draft_cap = slot.draft_cap if slot is not None and config.drafts_leave_output else None
        steps = decode(target, drafter, prompt_ids, config, stats, generator, draft_cap)
        try:
            for step in steps:
                for i in step.committed_relaxed:
                    relaxed_positions.append(len(token_ids) + step.relaxed_at[i])
                    relaxed_top1.append(step.relaxed_top1[i])
                    relaxed_margins.append(step.relaxed_margins[i])
                token_ids.extend(step.tokens)
                logprobs.extend(map(TokenLogprob, step.tokens, step.logprobs, step.top_logprobs))
                if step.finished:
                    finish = "eos"
                if detok is None:
                    continue
                delta = detok.push(step.tokens)
                cut = _find_stop(detok.text, len(delta), stops)
                if cut is not None:
                    delta = delta[: len(delta) - (len(detok.text) - cut)]
                    detok.text = detok.text[:cut]
                    finish = "stop"
                if delta:
                    stats.wall_s = time.perf_counter() - start
                    yield delta
                if finish == "stop":
                    break
        finally:
            steps.close()
            stats.wall_s = time.perf_counter() - start
        text = detok.text if detok is not None else self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return GenerationResult(
            text,
            token_ids,
            relaxed_positions,
            finish,
            stats,
            relaxed_top1,
            relaxed_margins,
            logprobs if opts.logprobs is not None else None,
        )


def _find_stop(text: str, new_chars: int, stops: tuple[str, ...]) -> int | None:
    """Index in ``text`` where the earliest stop string starts, searching only where new text could
    complete one."""
    if not stops:
        return None
    window = max(len(s) for s in stops) + new_chars
    base = max(0, len(text) - window)
    hits = [i for i in (text.find(s, base) for s in stops) if i >= 0]
    return min(hits) if hits else None


_last_loaded: dict[tuple, Decoder] = {}  # the last pair loaded (one at a time), by its arguments


def load_decoder(
    target: str,
    draft: str | None,
    dtype: str = DEFAULT_DTYPE,
    threads: int | None = None,
    settings: LoadSettings | None = None,
) -> Decoder:
    """A :class:`Decoder` for these arguments: the one loaded last when they are the same, else a new one
    (the old pair is let go first, so two pairs are never held at once). :func:`generate` and every
    command of the CLI load through it, so repeated calls are cheap."""
    settings = settings or LoadSettings()
    held = loaded_decoder(target, draft, dtype, threads, settings)
    if held is not None:
        return held
    _last_loaded.clear()
    decoder = Decoder(target, draft, dtype=dtype, threads=threads, **asdict(settings))
    _last_loaded[(target, draft, dtype, threads, settings)] = decoder
    return decoder


def loaded_decoder(
    target: str, draft: str | None, dtype: str, threads: int | None, settings: LoadSettings
) -> Decoder | None:
    """The pair :func:`load_decoder` holds for these arguments, or None when it would have to load."""
    return _last_loaded.get((target, draft, dtype, threads, settings))


def generate(
    prompt: Prompt,
    *,
    target: str = DEFAULT_TARGET,
    draft: str | None = DEFAULT_DRAFT,
    dtype: str = DEFAULT_DTYPE,
    threads: int | None = None,
    **kwargs: Any,
) -> GenerationResult:
    """One-call generation. The last-used models stay loaded, so repeated calls are cheap.

    ``kwargs`` are ``on_text`` and the fields of :class:`GenerationOptions`. ``threads``, when given, sets
    torch's process-wide thread count (see :class:`Decoder`).
    """
    return load_decoder(target, draft, dtype, threads).generate(prompt, **kwargs)
