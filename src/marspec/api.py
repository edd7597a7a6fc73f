"""The public API: ``Decoder`` keeps models loaded between calls; ``generate`` is the one-call form.

Longer than marspec's other modules on purpose: it is the surface users import (``Decoder``,
``GenerationOptions``, ``GenerationResult``, ``GenerationStream``, ``generate``), kept in one place to be
read as one. The work is elsewhere: the loop in ``decode.py``, settings in ``rules.py``, models in
``models/`` and ``backends/``.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import torch

from marspec.backends.hf import HFCausalLM, use_grouped_attention
from marspec.backends.prepack import prepack_linears
from marspec.backends.quantize import (
    check_draft_quant,
    check_target_quant,
    quantize_draft,
    quantize_target,
)
from marspec.calibration import load_choice
from marspec.decode import DecodeConfig, decode
from marspec.defaults import (
    DEFAULT_DRAFT_CONFIDENCE,
    DEFAULT_DRAFT_QUANT,
    DEFAULT_K,
    DEFAULT_LOOKUP,
    DEFAULT_PREPACK,
    GUARD_CLASSES,
)
from marspec.detok import IncrementalDetokenizer
from marspec.devices import resolve_device
from marspec.drafters import Drafter, HybridDrafter, ModelDrafter, NgramDrafter
from marspec.errors import MarspecError
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET, is_instruct, load_model, parse_dtype
from marspec.prompting import Prompt, encode_prompt
from marspec.rules import AUTO, Rule, RuleName, filled_setting, rule_name
from marspec.stats import GenerationStats
from marspec.token_classes import relaxable_table
from marspec.tree import parse_tree_shape

CPU = torch.device("cpu")
FinishReason = Literal["eos", "length", "stop"]


@dataclass
class GenerationResult:
    """What one generation produced.

    ``relaxed_positions`` are indices into ``token_ids`` of the tokens accepted by relaxation (the
    places where the output may differ from strict verification); ``relaxed_top1`` holds, for each, the
    token strict would have taken there (the target's top-1), and ``relaxed_margins`` the rule's margin.
    """

    text: str
    token_ids: list[int]
    relaxed_positions: list[int]
    finish_reason: FinishReason
    stats: GenerationStats = field(repr=False)
    relaxed_top1: list[int] = field(default_factory=list)
    relaxed_margins: list[float] = field(default_factory=list)

    def to_dict(self, with_steps: bool = False) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "relaxed_positions": self.relaxed_positions,
            "relaxed_top1": self.relaxed_top1,
            "relaxed_margins": self.relaxed_margins,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(with_steps=with_steps),
        }


class GenerationStream:
    """Iterate to receive text deltas as they are decoded; ``result`` is set once iteration ends."""

    def __init__(self, gen: Generator[str, None, GenerationResult]) -> None:
        self._gen = gen
        self.result: GenerationResult | None = None

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
) -> tuple[HFCausalLM, bool]:
    """Load a model by name or path onto ``device`` (or take a loaded one, left as it is); return it and
    whether prompts default to chat. ``prepack`` holds the linear weights of a model loaded here in
    oneDNN's layout, and on the CPU its attention groups key/value heads under masks (both CPU kernel
    choices: not applied on another device)."""
    if isinstance(model, HFCausalLM):
        return model, bool(getattr(model.tokenizer, "chat_template", None))
    hf_model, tokenizer, spec = load_model(model, dtype=dtype)
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


def check_same_tokenizer(target: HFCausalLM, draft: HFCausalLM) -> None:
    """A draft model is only usable if its token ids mean what the target's mean."""
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise MarspecError(
            f"draft model {draft.name!r} does not share the tokenizer of target {target.name!r}: "
            "their token ids mean different things; pick a draft from the target's family or use "
            "draft='ngram'"
        )


class Decoder:
    """A target model, optionally a drafter, loaded once and reused across generations.

    Args:
        target: a known model name (see ``marspec models``), a local HF model folder, a .gguf file or a
            Hugging Face Hub id ``ORG/NAME`` (from the HF cache, downloaded when online; docs/models.md).
        draft: a draft model (same forms; must share the target's tokenizer), ``"ngram"`` for prompt
            lookup, or ``None`` for plain decoding only.
        dtype: ``"fp32"`` (default: exact, and on CPUs without fast bf16 kernels as fast) or ``"bf16"``.
        threads: torch intra-op threads (default: torch's choice). This is ``torch.set_num_threads``,
            which is process-wide: it also changes the thread count of every other torch user in the
            process (and of Decoders created earlier), and stays set after this Decoder is gone.
        draft_quant: ``"int8"`` quantises the linear layers of a draft loaded by name (about 3x cheaper
            draft forwards on CPU; it does not touch the target, so exactness is unaffected), ``"int4"``
            to 4-bit weights in groups of 32 (about a sixth of fp32's weight bytes), or ``"none"``.
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
        target_quant: ``"int8"`` runs the target's linear layers in int8 with one activation scale per
            token (oneDNN, CPU only, fp32 target loaded by name): a smaller, faster target that is a
            different model from the fp32 one (its answers can differ), while strict verification still
            equals plain decoding of that int8 target. ``"int4"``: 4-bit weights in groups of 32 with bf16
            activations (ATen's int4 CPU kernel, fp32 or bf16 target loaded by name): about a sixth of
            fp32's weight bytes, a one-token step near int8's, but a verification forward costing several
            steps; strict equals plain decoding of that int4 target. ``"none"`` (default) keeps the
            target as loaded.
    """

    def __init__(
        self,
        target: str | HFCausalLM = DEFAULT_TARGET,
        draft: str | HFCausalLM | None = DEFAULT_DRAFT,
        *,
        dtype: str | torch.dtype = "fp32",
        threads: int | None = None,
        draft_quant: str = DEFAULT_DRAFT_QUANT,
        draft_confidence: float = DEFAULT_DRAFT_CONFIDENCE,
        lookup: bool = DEFAULT_LOOKUP,
        prepack: bool = DEFAULT_PREPACK,
        device: str | torch.device = "auto",
        target_quant: str = "none",
    ) -> None:
        self.device = resolve_device(device)
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise MarspecError(f"threads must be an integer >= 1, got {threads!r}")
            torch.set_num_threads(threads)
        if not (isinstance(draft_confidence, (int, float)) and 0.0 <= draft_confidence <= 1.0):
            raise MarspecError(f"draft_confidence must be a number in [0, 1], got {draft_confidence!r}")
        check_draft_quant(draft_quant)
        if not isinstance(prepack, bool):
            raise MarspecError(f"prepack must be true or false, got {prepack!r}")
        torch_dtype = parse_dtype(dtype)
        self.target_quant = _check_target_quant(target_quant, target, torch_dtype, self.device)
        quantized_target = self.target_quant != "none"
        self.target, self.chat_default = load_lm(
            target, torch_dtype, prepack and not quantized_target, self.device
        )
        if quantized_target:
            quantize_target(self.target.model, self.target_quant)
        on_cpu = self.device.type == "cpu"
        self.drafter: Drafter | None = None
        # The drafter's name as a calibration knows it (see marspec.calibration); None without one.
        self.draft_name: str | None = None
        if draft is None or draft == "none":
            pass
        elif draft == "ngram":
            self.drafter = NgramDrafter()
            self.draft_name = "ngram"
        else:
            # int8 (fbgemm) and int4 are CPU kernels: elsewhere the draft runs in the target's dtype.
            quantize = on_cpu and draft_quant != "none" and not isinstance(draft, HFCausalLM)
            # int8 kernels take fp32 activations; int4 ones bf16, so an int4 draft keeps the target's
            # dtype (bf16 halves its embedding). The draft's dtype does not bear on exactness anyway.
            draft_dtype = torch.float32 if quantize and draft_quant == "int8" else torch_dtype
            draft_lm, _ = load_lm(draft, draft_dtype, prepack and not quantize, self.device)
            check_same_tokenizer(self.target, draft_lm)
            if quantize:
                quantize_draft(draft_lm.model, draft_quant)
            self.draft_name = draft_lm.name
            model_drafter = ModelDrafter(draft_lm, self.target.vocab_size, min_confidence=draft_confidence)
            self.drafter = HybridDrafter(model_drafter) if lookup else model_drafter
        self.eos_token_ids = self.target.eos_token_ids

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def resolve_theta(self, opts: GenerationOptions) -> GenerationOptions:
        """``opts`` with the margin and theta it will decode with: ``theta="auto"`` replaced by this
        pair's calibrated setting, an unset one by the measured default (each for the greedy or the
        sampling regime, by ``opts.temperature``)."""
        if opts.theta != AUTO:
            return opts.with_defaults()
        if opts.rule != "mars" or self.draft_name is None:
            return replace(opts, theta=1.0).with_defaults()  # plain and strict never relax: no theta
        if self.target_quant != "none":
            raise MarspecError(
                f"theta='auto' reads a calibration of the unquantised target, and this Decoder's target is "
                f"{self.target_quant}: give theta a number (or use target_quant='none')"
            )
        rule = load_choice(self.target.name, self.draft_name, opts.temperature)
        return replace(opts, theta=rule.theta, margin=rule.margin)

    def generate(
        self, prompt: Prompt, *, on_text: Callable[[str], None] | None = None, **options: Any
    ) -> GenerationResult:
        """Generate a continuation of ``prompt`` (text, or chat messages ``[{"role", "content"}]``).

        ``options`` are the fields of :class:`GenerationOptions` (rule, theta, margin, k, temperature,
        seed, max_new_tokens, stop, chat). ``on_text`` receives text deltas as they are decoded.
        """
        gen = self._generate(prompt, GenerationOptions.of(options), stream=on_text is not None)
        while True:
            try:
                delta = next(gen)
            except StopIteration as done:
                return done.value
            if on_text is not None:
                on_text(delta)

    def stream(self, prompt: Prompt, **options: Any) -> GenerationStream:
        """Like ``generate`` but returns an iterator of text deltas; see ``GenerationStream``."""
        return GenerationStream(self._generate(prompt, GenerationOptions.of(options), stream=True))

    def _generate(
        self, prompt: Prompt, opts: GenerationOptions, stream: bool
    ) -> Generator[str, None, GenerationResult]:
        drafter = None if opts.rule == "plain" else self.drafter
        if opts.rule != "plain" and drafter is None:
            raise MarspecError(
                f"rule {opts.rule!r} needs a drafter: create the Decoder with draft=NAME or draft='ngram', "
                "or use rule='plain'"
            )
        opts = self.resolve_theta(opts)
        config = opts.decode_config(self.eos_token_ids)
        if config.rule.guard == "class":  # the table is computed once per tokenizer, then reused
            table = relaxable_table(self.tokenizer, self.target.vocab_size, GUARD_CLASSES)
            # The verifier indexes it with token ids on the target's device (a CUDA target included).
            config = replace(config, relaxable=table.to(self.target.device))
        stops = _check_stops(opts.stop)
        chat = self.chat_default if opts.chat is None else opts.chat
        prompt_ids = encode_prompt(self.tokenizer, prompt, chat, self.target.name).to(self.target.device)
        ctx = self.target.context_length
        if ctx and prompt_ids.shape[0] >= ctx:
            raise MarspecError(
                f"prompt is {prompt_ids.shape[0]} tokens but {self.target.name!r} has a context of {ctx}: "
                "shorten the prompt"
            )
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
        steps = decode(self.target, drafter, prompt_ids, config, stats, generator)
        try:
            for step in steps:
                relaxed_positions.extend(len(token_ids) + i for i, r in enumerate(step.relaxed) if r)
                relaxed_top1.extend(step.relaxed_top1)
                relaxed_margins.extend(step.relaxed_margins)
                token_ids.extend(step.tokens)
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
            text, token_ids, relaxed_positions, finish, stats, relaxed_top1, relaxed_margins
        )


@dataclass(frozen=True)
class GenerationOptions:
    """How to generate.

    Attributes:
        rule: ``plain`` (no drafter), ``strict`` (lossless speculative), ``mars`` (relax near-ties), or
            a rival lossy rule for comparisons: ``typical`` (Medusa), ``pthresh`` (SGLang), ``topk``
            (TensorRT-LLM) or ``fly`` (FLy, with ``window``), whose parameter is ``theta`` (see
            :mod:`marspec.verify`, docs/rules.md).
            Not named (None): ``strict`` (:data:`marspec.defaults.DEFAULT_RULE`), lossless: the output
            is the target's own decoding, token for token when greedy. A ``theta`` or ``margin`` with
            no rule named is an error, since they tune a lossy rule. After construction this field
            holds the rule in use.
        theta: MARS closeness threshold; for the ratio margins in [0, 1] (1 never relaxes = strict).
            Unset (None), MARS takes the setting measured on the default pair for the decoding regime
            (:func:`marspec.defaults.default_setting`): 0.5 on ``prob_ratio`` when greedy
            (docs/results.md, "MARS quality"); the paper's setting is ``theta=0.9,
            margin="logit_ratio"``. A rival rule needs its parameter here.
            ``"auto"`` takes the margin and theta that ``marspec calibrate`` measured for this target and
            drafter (greedy and sampling are calibrated apart); without a calibration, an error says
            how to make one.
        margin: ``prob_ratio`` (p2/p1, the default), ``logit_ratio`` (the paper's z2/z1) or
            ``logit_gap`` (z1 - z2, then theta is the largest gap in logits that still relaxes).
            Named without a theta, a margin takes its usual threshold (0.9 on ``logit_ratio``, ln 2
            on ``logit_gap``), since one number means different closeness on each.
        k: most draft tokens proposed per step (>= 1); a confident drafter's drafts end earlier.
        adaptive_k: grow the draft length by 2 after a fully accepted draft and shrink it by 1 after a
            rejection, between 1 and ``k`` (transformers' schedule); off drafts up to ``k`` every step.
        temperature: 0 decodes greedily; above 0 samples (speculative sampling, lossless for strict).
        seed: makes sampling reproducible.
        max_new_tokens: upper bound on generated tokens (>= 1).
        stop: strings that end generation; the text is cut before the stop string.
        chat: apply the chat template to a string prompt (default: yes for instruct models).
        tree: token-tree drafting (greedy only, needs a draft model): candidates per depth, e.g.
            ``"3,2"`` also verifies the draft's two runner-up tokens at depth 1 and one at depth 2, in
            the same target forward; ``None`` drafts a plain chain.
        guard: ``"none"`` (MARS as published) or ``"next"``, a variant of ours that relaxes a close
            call only where the target, after the relaxed token, predicts the draft's next token
            (see :mod:`marspec.verify`); chains only. ``"class"`` (MARS or a rival) relaxes only where
            the draft token and the top-1 it replaces are of the token classes measured harmless
            (docs/rules.md).
        window: FLy's deferral window (``rule="fly"`` only; unset: the source's 6).
        reuse_prefix: keep the cached part of the prompt that the previous generation of this Decoder
            already scored (its prompt and output: the earlier turns of a chat) instead of scoring it
            again; ``stats.reused_tokens`` says how many of the target's prompt tokens that spared. In
            fp32 the output is the one a fresh prefill gives (tested on real weights); in bf16 the kept
            keys and values, computed in other chunks, may round a near-tie the other way, so turn it
            off for runs that must not depend on order. An int8 draft always re-reads the whole prompt
            (dynamic quantisation scales each forward as a whole, so its cache depends on chunking).
    """

    rule: str | None = None
    theta: float | Literal["auto"] | None = None
    margin: str | None = None
    k: int = DEFAULT_K
    adaptive_k: bool = False
    temperature: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: Sequence[str] | str | None = None
    chat: bool | None = None
    tree: str | Sequence[int] | None = None
    guard: str = "none"
    reuse_prefix: bool = True
    window: int | None = None

    def __post_init__(self) -> None:
        # Frozen: the resolved rule is written once, here, so every later copy (replace) holds it named.
        object.__setattr__(self, "rule", rule_name(self.rule, self.theta, self.margin))
        # Rule.of checks rule, theta, margin, guard and window (marspec.rules, the one place; "auto" as
        # unset, resolved per pair later), DecodeConfig the rest: k, temperature, max_new_tokens, tree.
        self._decode_config(self.to_rule(), frozenset())
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64
        ):
            raise MarspecError(f"seed must be an integer that fits in 64 bits, got {self.seed!r}")
        _check_stops(self.stop)

    @classmethod
    def of(cls, options: dict[str, Any]) -> GenerationOptions:
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise MarspecError(
                f"unknown generation option(s) {', '.join(unknown)}: valid ones are "
                + ", ".join(f.name for f in fields(cls))
            )
        return cls(**options)

    def with_defaults(self) -> GenerationOptions:
        """These options with an unset theta or margin replaced by the measured default for this
        temperature (``theta="auto"`` is left for :meth:`Decoder.resolve_theta`)."""
        if self.theta == AUTO:
            return self
        margin, theta = filled_setting(RuleName(self.rule), self.theta, self.margin, self.temperature)
        if (margin, theta) == (self.margin, self.theta):
            return self
        return replace(self, margin=margin, theta=theta)

    def to_rule(self) -> Rule:
        """The :class:`~marspec.rules.Rule` these options verify with (``plain`` never verifies a draft:
        ``strict``), unset values filled for the temperature; ``theta="auto"`` is checked as unset."""
        return Rule.of(self.rule, self.theta, self.margin, self.guard, self.window, self.temperature)

    def decode_config(self, eos_token_ids: frozenset[int]) -> DecodeConfig:
        if self.theta == AUTO:
            raise MarspecError("theta='auto' must be resolved for a model pair first (Decoder does this)")
        return self._decode_config(self.to_rule(), eos_token_ids)

    def _decode_config(self, rule: Rule, eos_token_ids: frozenset[int]) -> DecodeConfig:
        return DecodeConfig(
            rule=rule,
            k=self.k,
            adaptive_k=self.adaptive_k,
            temperature=self.temperature,
            max_new_tokens=self.max_new_tokens,
            eos_token_ids=eos_token_ids,
            tree=parse_tree_shape(self.tree),
            reuse_prefix=self.reuse_prefix,
        )


def _check_stops(stop: Sequence[str] | str | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stops):
        raise MarspecError("stop strings must be non-empty strings")
    return stops


def _find_stop(text: str, new_chars: int, stops: tuple[str, ...]) -> int | None:
    """Index in ``text`` where the earliest stop string starts, searching only where new text could
    complete one."""
    if not stops:
        return None
    window = max(len(s) for s in stops) + new_chars
    base = max(0, len(text) - window)
    hits = [i for i in (text.find(s, base) for s in stops) if i >= 0]
    return min(hits) if hits else None


@functools.lru_cache(maxsize=1)
def _cached_decoder(target: str, draft: str | None, dtype: str, threads: int | None) -> Decoder:
    return Decoder(target, draft, dtype=dtype, threads=threads)


def generate(
    prompt: Prompt,
    *,
    target: str = DEFAULT_TARGET,
    draft: str | None = DEFAULT_DRAFT,
    dtype: str = "fp32",
    threads: int | None = None,
    **kwargs: Any,
) -> GenerationResult:
    """One-call generation. The last-used models stay loaded, so repeated calls are cheap.

    ``kwargs`` are ``on_text`` and the fields of :class:`GenerationOptions`. ``threads``, when given, sets
    torch's process-wide thread count (see :class:`Decoder`).
    """
    return _cached_decoder(target, draft, dtype, threads).generate(prompt, **kwargs)
