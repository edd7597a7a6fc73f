"""The public API: ``Decoder`` keeps models loaded between calls; ``generate`` is the one-call form.

The surface users import (``Decoder``, ``GenerationOptions``, ``GenerationResult``, ``GenerationStream``,
``generate``), kept in one place to be read as one. The work is elsewhere: the loop in ``decode.py``,
settling a generation's options in ``settings.py`` (where ``GenerationOptions`` lives), loading a pair
(the checks before any weight loads, then the assembly from its parts) in ``loading.py``, models in
``models/`` and ``backends/``, the precision chosen in ``precision.py``.

A third of it is ``Decoder``'s documentation of every argument, which users read here
(``help(marspec.Decoder)``); the rest is the generation entry points users call on a loaded pair (one
sequence here; several delegate to ``marspec.batch``).
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
from marspec.backends.hf import HFCausalLM
from marspec.backends.threads import in_passing_thread
from marspec.batch.many import BatchStream, decode_many
from marspec.batch.slots import Slot
from marspec.decode import DecodeConfig, Step, decode_steps
from marspec.defaults import DEFAULT_DTYPE
from marspec.detok import IncrementalDetokenizer
from marspec.draft_length import DraftChoice, PairKey, draft_choice, measuring_allowed
from marspec.drafters import HybridDrafter, ModelDrafter
from marspec.errors import MarspecError
from marspec.forward_requests import Request, solo
from marspec.load_settings import LoadSettings
from marspec.loading import check_same_tokenizer as check_same_tokenizer  # the CLI's, before a load
from marspec.loading import load_lm as load_lm  # what Decoder loads one model with
from marspec.loading import load_pair
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET
from marspec.prompting import Prompt, encode_prompt
from marspec.rules import uses_drafter
from marspec.settings import GenerationOptions, Pair, settle, stop_strings
from marspec.stats import GenerationStats

if TYPE_CHECKING:
    pass

log = logging.getLogger("marspec")

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
            (0 always drafts ``k`` tokens; then ``k`` is a fixed length rather than a maximum). None
            (default): with a draft model on the CPU, the stop, and the default ``k`` of generations
            that name none, are chosen from this machine's costs, measured the first time the pair
            loads and kept in the model cache (:mod:`marspec.draft_length`; ``draft_choice`` says what
            was chosen and why). A stop named here: nothing is measured, and ``k`` is 8 unless a
            generation names it; so too with ``MARSPEC_DRAFT_COSTS=off``, another drafter or device.
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
        draft_confidence: float | None = LoadSettings.draft_confidence,
        lookup: bool = LoadSettings.lookup,
        prepack: bool = LoadSettings.prepack,
        device: str | torch.device = LoadSettings.device,
        target_quant: str = LoadSettings.target_quant,
        graphs: str = LoadSettings.graphs,
    ) -> None:
        settings = LoadSettings(draft_quant, draft_confidence, lookup, prepack, device, target_quant, graphs)  # type: ignore[arg-type]
        # load_lm as this module names it, so that a test may stand in for the loading of one model.
        loaded = load_pair(target, draft, dtype, threads, settings, load=load_lm)
        self.device, self.fixed_shape, self.captured = loaded.device, loaded.fixed_shape, loaded.captured
        self.target_quant, self.target = loaded.target_quant, loaded.target
        self.chat_default, self.drafter = loaded.chat_default, loaded.drafter
        self.draft_name, self.draft_weights = loaded.draft_name, loaded.draft_weights
        self.target_weights = loaded.target_weights
        self.eos_token_ids = self.target.eos_token_ids
        # The draft length and stop measured for this machine and pair (None: the fixed defaults).
        self.draft_choice = in_passing_thread(lambda: self._choose_draft(draft_confidence))
        # What settling a generation needs of this pair (marspec.settings.settle).
        self.pair = Pair(
            target=self.target.name,
            draft=self.draft_name,
            eos_token_ids=self.eos_token_ids,
            target_quant=self.target_quant,
            tokenizer=self.tokenizer,
            vocab_size=self.target.vocab_size,
            device=self.target.device,
            k=None if self.draft_choice is None else self.draft_choice.k,
        )
        if loaded.hint is not None:  # once the pair has loaded, so that an error comes alone
            log.warning(loaded.hint)
        if self.target_quant != "none" and isinstance(self.target, HFCausalLM):
            note = fallback_note(self.target.model, self.target.name, self.target_quant)
            if (
                note is not None
            ):  # a family the direct forward does not take: transformers' forward, said once
                log.warning(note)

    def _choose_draft(self, named_stop: float | None) -> DraftChoice | None:
        """The draft length and stop this machine's costs favour (:mod:`marspec.draft_length`), the stop
        set on the drafter: for a draft model on the CPU whose stop the caller did not name, unless
        ``$MARSPEC_DRAFT_COSTS`` is off. None: the fixed defaults apply."""
        drafter = self.drafter.model if isinstance(self.drafter, HybridDrafter) else self.drafter
        if (
            named_stop is not None
            or not isinstance(drafter, ModelDrafter)
            or self.device.type != "cpu"
            or not measuring_allowed()
        ):
            return None
        from marspec.draft_length.calibration_text import CALIBRATION_PROMPTS
        from marspec.eval.cpu import cpu_name

        assert self.draft_name is not None and self.draft_weights is not None  # set with the drafter
        from marspec.backends import kernels

        # The kernel path and its build decide a verification's cost as much as the CPU does (AVX2 against
        # AVX-512; kernels changed since a measurement).
        path = kernels.process_path() if kernels.kernels_available() else None
        key = PairKey(
            cpu_name(),
            torch.get_num_threads(),
            "none" if path is None else f"{path.name} {kernels.build_id(path)}",
            self.target.name,
            self.target_weights,
            self.draft_name,
            self.draft_weights,
        )
        options = GenerationOptions()  # the prompts in the pair's own form (chat for an instruct model)
        choice = draft_choice(
            key,
            self.target,
            drafter,
            lambda: [self.prompt_ids(p, options) for p in CALIBRATION_PROMPTS],
            self.eos_token_ids,
            announce=_announce,
        )
        drafter.min_confidence = choice.stop
        return choice

    @property
    def draft_stop(self) -> float | None:
        """The drafter's confidence stop (None for a drafter without one: prompt lookup)."""
        drafter = self.drafter.model if isinstance(self.drafter, HybridDrafter) else self.drafter
        return getattr(drafter, "min_confidence", None)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def settle(self, opts: GenerationOptions) -> DecodeConfig:
        """What ``opts`` decode with on this pair (:func:`marspec.settings.settle`): ``theta="auto"``
        read from the pair's calibration, unset settings filled, the class guard's table built."""
        return settle(opts, self.pair)

    def resolve_theta(self, opts: GenerationOptions) -> GenerationOptions:
        """``opts`` naming the margin, theta and k :meth:`settle` decodes them with (``theta="auto"``
        resolved, unset ones filled), for echoing to a caller; the values are settle's."""
        config = self.settle(opts)
        return replace(opts, theta=config.rule.theta, margin=config.rule.margin, k=config.k)

    def generate(
        self, prompt: Prompt, *, on_text: Callable[[str], None] | None = None, **options: Any
    ) -> GenerationResult:
        """Generate a continuation of ``prompt`` (text, or chat messages ``[{"role", "content"}]``).

        ``options`` are the fields of :class:`GenerationOptions` (rule, theta, margin, k, temperature,
        seed, max_new_tokens, stop, chat). ``on_text`` receives text deltas as they are decoded.
        """
        opts = GenerationOptions.of(options)
        gen = solo(self._generate(prompt, opts, stream=on_text is not None, logprobs=[]))
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
        return GenerationStream(solo(self._generate(prompt, opts, stream=True, logprobs=logprobs)), logprobs)

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
        for; raises a one-line error when it leaves no room in the target's context or holds a token the
        target has no row for."""
        chat = self.chat_default if opts.chat is None else opts.chat
        prompt_ids = encode_prompt(self.tokenizer, prompt, chat, self.target.name)
        vocab = self.target.vocab_size
        if prompt_ids.numel() and int(prompt_ids.max()) >= vocab:  # its forward would fail deep in torch
            bad = int(prompt_ids.max())
            raise MarspecError(
                f"the prompt holds token {self.tokenizer.convert_ids_to_tokens(bad)!r} (id {bad}), which "
                f"{self.target.name!r} has no row for (its vocabulary has {vocab}): the tokenizer knows "
                "tokens the model does not (added tokens?); leave that text out of the prompt"
            )
        prompt_ids = prompt_ids.to(self.target.device)
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
    ) -> Generator[Request | str, torch.Tensor | None, GenerationResult]:
        """:meth:`stream`'s generation on a batch's slot (:mod:`marspec.batch`): its caches, its drafter,
        its forwards asked for (:mod:`marspec.forward_requests`) for the batch to run; ``logprobs`` as
        :meth:`_generate` fills it."""
        return self._generate(prompt, opts, stream, [] if logprobs is None else logprobs, slot)

    def _generate(
        self,
        prompt: Prompt,
        opts: GenerationOptions,
        stream: bool,
        logprobs: list[TokenLogprob],
        slot: Slot | None = None,
    ) -> Generator[Request | str, torch.Tensor | None, GenerationResult]:
        """The generation as text deltas (when ``stream`` or stop strings ask for them), on ``slot`` when
        given (else the pair's own caches), asking for its model forwards (:func:`solo` runs them at
        once); its tokens' log probabilities, with the ``logprobs`` option, are appended to ``logprobs``
        as they are decoded."""
        config = self.settle(opts)
        target = self.target if slot is None else slot.target
        drafter = None if not uses_drafter(opts.rule) else self.drafter if slot is None else slot.drafter
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
        steps = decode_steps(target, drafter, prompt_ids, config, stats, generator, draft_cap)
        reply: torch.Tensor | None = None
        every_token = False  # the loop decoded all it would (not cut by a stop string)
        try:
            while True:
                try:
                    step = steps.send(reply)
                except StopIteration:
                    every_token = True
                    break
                if not isinstance(step, Step):  # a forward: asked of whoever drives this generation
                    reply = yield step
                    continue
                reply = None
                _take(step, token_ids, relaxed_positions, relaxed_top1, relaxed_margins, logprobs)
                if step.finished:
                    finish = "eos"
                if detok is None:
                    continue
                delta, stopped = _cut_at_stop(detok, detok.push(step.tokens), stops)
                if stopped:
                    finish = "stop"
                if delta:
                    stats.wall_s = time.perf_counter() - start
                    yield delta
                if stopped:
                    break
            if every_token and detok is not None:  # the text held back (a character cut) ends the stream
                delta, stopped = _cut_at_stop(detok, detok.flush(), stops)
                if stopped:
                    finish = "stop"
                if delta:
                    stats.wall_s = time.perf_counter() - start
                    yield delta
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


def _take(
    step: Step,
    token_ids: list[int],
    relaxed_positions: list[int],
    relaxed_top1: list[int],
    relaxed_margins: list[float],
    logprobs: list[TokenLogprob],
) -> None:
    """``step``'s tokens, relaxed positions and log probabilities appended to a generation's."""
    for i in step.committed_relaxed:
        relaxed_positions.append(len(token_ids) + step.relaxed_at[i])
        relaxed_top1.append(step.relaxed_top1[i])
        relaxed_margins.append(step.relaxed_margins[i])
    token_ids.extend(step.tokens)
    logprobs.extend(map(TokenLogprob, step.tokens, step.logprobs, step.top_logprobs))


def _cut_at_stop(detok: IncrementalDetokenizer, delta: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``delta`` (the text ``detok`` just added) cut before the earliest stop string, and whether one was
    found; ``detok.text`` is cut there too."""
    cut = _find_stop(detok.text, len(delta), stops)
    if cut is None:
        return delta, False
    delta = delta[: len(delta) - (len(detok.text) - cut)]
    detok.text = detok.text[:cut]
    return delta, True


def _announce(line: str) -> None:
    """A line about loading on stderr, dimmed, as the model cache's conversions print theirs."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[dim]marspec: {escape(line)}[/]", highlight=False)


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
