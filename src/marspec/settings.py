"""A generation's settings: what a caller may set (:class:`GenerationOptions`) and the one function that
settles them (:func:`settle`) into what the decode loop runs with (:class:`~marspec.decode.DecodeConfig`).

Settling is the only place a default is filled: an unnamed rule (strict), ``plain`` verifying as strict,
MARS's margin and theta for the decoding regime (greedy or sampling, measured: :mod:`marspec.defaults`),
FLy's theta and window, ``theta="auto"`` from the pair's calibration (:mod:`marspec.calibration`), the
draft length from the pair's measured costs (:mod:`marspec.draft_length`) or the default, the tree shape
parsed once and the class guard's table. :class:`~marspec.rules.Rule` and ``DecodeConfig`` only check
ranges. Every entry point settles here: the library (``Decoder.generate``), and through it the CLI
and the server; the bench's method names and its run (``eval/methods.py``, ``eval/harness.py``);
calibration; the vLLM plugin's configuration (:func:`settle_rule`). So a bad setting gets one line from
each (tests/test_rules.py), and an unset setting means the same everywhere.

This module sits below the layers that call it and above the ones it reads (rules, defaults,
calibration, the loop's config type): settling never calls back up (tests/test_import_graph.py,
``python tests/test_import_graph.py`` lists the calls each entry point makes while settling).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from marspec import defaults
from marspec.calibration import load_choice
from marspec.errors import MarspecError
from marspec.rules import AUTO, Guard, Rule, RuleName, rule_family

if TYPE_CHECKING:
    import torch

    from marspec.decode import DecodeConfig


@dataclass(frozen=True)
class Pair:
    """What settling needs to know of the model pair a generation runs on (a :class:`~marspec.api.Decoder`
    makes one when it loads; the bench and the CLI can make one from names, before loading).

    ``target`` and ``draft`` are the names a calibration knows them by (``draft`` None: no drafter);
    ``tokenizer``, ``vocab_size`` and ``device`` are what the class guard's table is built from (once
    per tokenizer, :func:`marspec.token_classes.relaxable_table`), when a generation uses that guard.
    """

    target: str
    draft: str | None
    eos_token_ids: frozenset[int] = frozenset()
    target_quant: str = "none"
    tokenizer: Any = None
    vocab_size: int = 0
    device: torch.device | None = None
    k: int | None = None  # the draft length chosen for this machine (marspec.draft_length); None: the default


@dataclass(frozen=True)
class GenerationOptions:
    """How to generate.

    Attributes:
        rule: ``plain`` (no drafter), ``strict`` (lossless speculative), ``mars`` (relax near-ties), or
            a rival lossy rule for comparisons: ``typical`` (Medusa), ``pthresh`` (SGLang), ``topk``
            (TensorRT-LLM) or ``fly`` (FLy, with ``window``), whose parameter is ``theta`` (see
            :mod:`marspec.verify.relax`, docs/rules.md).
            Not named (None): ``strict`` (:data:`marspec.defaults.DEFAULT_RULE`), lossless: the output
            is the target's own decoding, token for token when greedy. A ``theta`` or ``margin`` with
            no rule named is an error, since they tune a lossy rule. After construction this field
            holds the rule in use (``plain`` stays ``plain``: it decodes without a drafter).
        theta: MARS closeness threshold; for the ratio margins in [0, 1] (1 never relaxes = strict).
            Unset (None), MARS takes the setting measured on the default pair for the decoding regime
            (:func:`settle`, from :mod:`marspec.defaults`): 0.5 on ``prob_ratio`` when greedy
            (docs/results.md, "MARS quality"); the paper's setting is ``theta=0.9,
            margin="logit_ratio"``. A rival rule needs its parameter here.
            ``"auto"`` takes the margin and theta that ``marspec calibrate`` measured for this target and
            drafter (greedy and sampling are calibrated apart); without a calibration, an error says
            how to make one.
        margin: ``prob_ratio`` (p2/p1, the default), ``logit_ratio`` (the paper's z2/z1) or
            ``logit_gap`` (z1 - z2, then theta is the largest gap in logits that still relaxes).
            Named without a theta, a margin takes its usual threshold (0.9 on ``logit_ratio``, ln 2
            on ``logit_gap``), since one number means different closeness on each.
        k: most draft tokens proposed per step (>= 1); a confident drafter's drafts end earlier. Unset
            (None): the length chosen for the pair from this machine's costs when it loaded
            (:mod:`marspec.draft_length`), else :data:`marspec.defaults.DEFAULT_K`.
        adaptive_k: grow the draft length by 2 after a fully accepted draft and shrink it by 1 after a
            rejection, between 1 and ``k`` (transformers' schedule); off drafts up to ``k`` every step.
        temperature: 0 decodes greedily; above 0 samples (speculative sampling, lossless for strict).
            Below :data:`marspec.defaults.GREEDY_BELOW_TEMPERATURE` (1e-5, vLLM's floor) it decodes
            greedily too: such a temperature leaves the top token all the mass, and dividing by it
            would overflow the logits.
        seed: makes sampling reproducible.
        max_new_tokens: upper bound on generated tokens (>= 1).
        stop: strings that end generation; the text is cut before the stop string.
        chat: apply the chat template to a string prompt (default: yes for instruct models).
        tree: token-tree drafting (greedy only, needs a draft model): candidates per depth, e.g.
            ``"3,2"`` also verifies the draft's two runner-up tokens at depth 1 and one at depth 2, in
            the same target forward; ``None`` drafts a plain chain.
        guard: ``"none"`` (MARS as published) or ``"next"``, a variant of ours that relaxes a close
            call only where the target, after the relaxed token, predicts the draft's next token
            (see :mod:`marspec.verify.relax`); chains only. ``"class"`` (MARS or a rival) relaxes only where
            the draft token and the top-1 it replaces are of the token classes measured harmless
            (docs/rules.md). ``"thinking"`` (any lossy rule) relaxes only inside a reasoning model's
            thinking span, between the markers ``thinking`` names, and verifies the rest strictly.
        thinking: the ``thinking`` guard's span markers, ``(start, end)``, each one token of the
            target's vocabulary; unset: the tokenizer's ``<think>`` and ``</think>``.
        window: FLy's deferral window (``rule="fly"`` only; unset: the source's 6).
        reuse_prefix: keep the cached part of the prompt that the previous generation of this Decoder
            already scored (its prompt and output: the earlier turns of a chat) instead of scoring it
            again; ``stats.reused_tokens`` says how many of the target's prompt tokens that spared. In
            fp32 the output is the one a fresh prefill gives (tested on real weights); in bf16 the kept
            keys and values, computed in other chunks, may round a near-tie the other way, so turn it
            off for runs that must not depend on order. An int8 draft always re-reads the whole prompt
            (dynamic quantisation scales each forward as a whole, so its cache depends on chunking).
        logprobs: None (off), or N in [0, 20]: return each generated token's log probability under the
            target at temperature 1 (its raw logits, read from the verification forward that emitted the
            token) and the target's N most likely tokens there (``GenerationResult.logprobs``). A relaxed
            MARS token gets its own, lower, log probability. Off costs nothing; on, one more small copy to
            the host per step.
    """

    rule: str | None = None
    theta: float | Literal["auto"] | None = None
    margin: str | None = None
    k: int | None = None
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
    thinking: tuple[str, str] | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Frozen: the rule in use is written once, here, so every later copy (replace) holds it named.
        object.__setattr__(self, "rule", rule_name(self.rule, self.theta, self.margin))
        settle(self)  # every check, before any model is loaded; "auto" is checked as unset until a pair

    @classmethod
    def of(cls, options: dict[str, Any]) -> GenerationOptions:
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise MarspecError(
                f"unknown generation option(s) {', '.join(unknown)}: valid ones are "
                + ", ".join(f.name for f in fields(cls))
            )
        return cls(**options)


def settle(options: GenerationOptions, pair: Pair | None = None) -> DecodeConfig:
    """The decode configuration ``options`` describe on ``pair``: every setting checked, every unset one
    filled (the rule, its margin, theta, guard and window by :func:`settle_rule`; the tree shape parsed;
    the class guard's table built by the pair). Without a pair (options checked before any model is
    loaded) ``theta="auto"`` is checked as unset and no table is built."""
    # The checks that need torch are imported past the rule's: this module stays light, so the command
    # line can refuse a bad rule or theta without loading torch (tests/test_cli_imports.py).
    name = rule_name(options.rule, options.theta, options.margin)
    if pair is not None and rule_family(name).verifies and pair.draft is None:
        raise MarspecError(
            f"rule {name!r} needs a drafter: create the Decoder with draft=NAME or draft='ngram', "
            "or use rule='plain'"
        )
    calibrated = None if pair is None else _calibration(pair)
    temperature = decoding_temperature(options.temperature)
    rule = settle_rule(
        name, options.theta, options.margin, options.guard, options.window, temperature, calibrated
    )
    check_seed(options.seed)
    stop_strings(options.stop)
    from marspec.decode import DecodeConfig
    from marspec.drafters.tree import parse_tree_shape
    from marspec.thinking import check_marker_strings, thinking_markers
    from marspec.token_classes import relaxable_table

    marker_strings = check_marker_strings(options.thinking)
    if marker_strings is not None and rule.guard is not Guard.THINKING:
        raise MarspecError(
            "thinking markers are the 'thinking' guard's: set guard='thinking' or leave thinking unset",
            field="thinking",
        )
    if pair is not None and rule.family.needs_draft_probs and pair.draft == "ngram":
        raise MarspecError(
            "the ensemble rule mixes the drafter's distribution into the target's, and prompt lookup "
            "(draft='ngram') has none: use a draft model or an EAGLE-3 head",
            field="rule",
        )
    markers = None
    if pair is not None and pair.tokenizer is not None and rule.guard is Guard.THINKING:
        markers = thinking_markers(pair.tokenizer, marker_strings)
    relaxable = None
    if pair is not None and pair.tokenizer is not None and rule.guard is Guard.CLASS:
        # The verifier indexes it with token ids on the target's device (a CUDA target included).
        table = relaxable_table(pair.tokenizer, pair.vocab_size, defaults.GUARD_CLASSES)
        relaxable = table.to(pair.device)
    return DecodeConfig(
        rule=rule,
        k=draft_length(options.k, pair),
        adaptive_k=options.adaptive_k,
        temperature=temperature,
        max_new_tokens=options.max_new_tokens,
        eos_token_ids=frozenset() if pair is None else pair.eos_token_ids,
        tree=parse_tree_shape(options.tree),
        reuse_prefix=options.reuse_prefix,
        relaxable=relaxable,
        thinking=markers,
        logprobs=options.logprobs,
    )


def decoding_temperature(temperature: object) -> object:
    """The temperature a generation decodes at: 0 (greedy) for one below
    :data:`marspec.defaults.GREEDY_BELOW_TEMPERATURE`, whose sampling would divide logits past float32's
    range; any other value as given (a negative or non-finite one for ``DecodeConfig`` to refuse)."""
    if isinstance(temperature, numbers.Real) and 0 < temperature < defaults.GREEDY_BELOW_TEMPERATURE:
        return 0.0
    return temperature


def draft_length(k: int | None, pair: Pair | None) -> int:
    """``k`` when named, else the length chosen for ``pair`` on this machine, else the default."""
    if k is not None:
        return k
    if pair is not None and pair.k is not None:
        return pair.k
    return defaults.DEFAULT_K


def settle_rule(
    rule: object = None,
    theta: object = None,
    margin: object = None,
    guard: object = Guard.NONE,
    window: object = None,
    temperature: object = 0.0,
    calibrated: Callable[[float], Rule] | None = None,
) -> Rule:
    """The :class:`~marspec.rules.Rule` a user's settings describe: an unset ``rule`` is
    :func:`rule_name`'s, ``plain`` verifies as ``strict`` (it never has a draft to verify); unset
    ``margin``/``theta`` take the measured setting of ``temperature``'s regime (a lossless rule carries it
    too, unused, so that what is echoed and recorded is complete); a rival's theta has no default except
    FLy's, whose window has one too. ``theta="auto"`` is MARS's: ``calibrated(temperature)`` gives the
    pair's stored rule; without it (no pair yet) it is checked as unset; a lossless rule takes theta 1."""
    name = rule_name(rule, theta, margin)
    family = rule_family(name)
    if theta == AUTO:
        if not family.margin_theta:
            raise MarspecError(
                f"theta='auto' is MARS's calibrated setting; give rule {name!r} its parameter as a "
                "number (see docs/rules.md)",
                field="theta",
            )
        if family.calibrates and calibrated is not None:
            stored = calibrated(temperature)  # type: ignore[arg-type]
            theta, margin = stored.theta, stored.margin
        else:  # plain and strict never relax: nothing to calibrate
            theta = None if family.calibrates else 1.0
    margin, regime_theta = _regime_setting(temperature, margin, theta)
    if family.takes_window:  # FLy: its theta and window have defaults of their own
        theta = defaults.FLY_THETA if theta is None else theta
        window = defaults.FLY_WINDOW if window is None else window
    elif family.margin_theta:
        theta = regime_theta
    verified = name if family.verifies else RuleName.STRICT  # plain never has a draft to verify
    return Rule(verified, theta, margin, guard, window)  # type: ignore[arg-type]


def rule_name(rule: object, theta: object = None, margin: object = None) -> RuleName:
    """The rule to decode with: ``rule`` when one is named, else :data:`marspec.defaults.DEFAULT_RULE`.

    With no rule named, a ``theta`` or ``margin`` is refused rather than ignored or taken to mean MARS:
    they tune a lossy rule, and either guess would change what the caller gets without saying so."""
    if rule is None:
        if theta is not None or margin is not None:
            pairs = (("theta", theta), ("margin", margin))
            given = ", ".join(f"{k}={v!r}" for k, v in pairs if v is not None)
            raise MarspecError(
                f"{given} tunes a lossy rule but no rule is named, and the default rule "
                f"({defaults.DEFAULT_RULE}) never relaxes: name one, e.g. rule='mars' (CLI --rule mars, "
                "server marspec.rule)",
                field="rule",
            )
        rule = defaults.DEFAULT_RULE
    return RuleName.parse(rule, "rule")


def _regime_setting(temperature: object, margin: object, theta: object) -> tuple[object, object]:
    """MARS's ``(margin, theta)`` where a caller left ``margin`` and/or ``theta`` unset (None).

    Both unset: the measured setting of the decoding regime (greedy, or sampling when ``temperature`` >
    0). Only ``theta`` given: it applies to that regime's margin. Only ``margin`` given: the regime's
    theta if it is that regime's margin, else the margin's own usual threshold
    (:data:`marspec.defaults.MARGIN_THETA`: one number means different closeness on each margin). Values
    are not checked here (an unknown margin or a temperature that is not a number is passed on for
    ``Rule`` and ``DecodeConfig`` to name)."""
    sampling = isinstance(temperature, numbers.Real) and temperature > 0
    if sampling:
        regime_margin, regime_theta = defaults.SAMPLING_MARGIN, defaults.SAMPLING_THETA
    else:
        regime_margin, regime_theta = defaults.DEFAULT_MARGIN, defaults.DEFAULT_THETA
    if theta is not None:
        return margin or regime_margin, theta
    if margin is None or margin == regime_margin:
        return regime_margin, regime_theta
    return margin, defaults.MARGIN_THETA.get(margin, regime_theta) if isinstance(
        margin, str
    ) else regime_theta


def _calibration(pair: Pair) -> Callable[[float], Rule]:
    """The pair's stored MARS setting for a temperature (read when ``theta="auto"`` asks for it)."""
    return calibration_of(pair.target, pair.draft, pair.target_quant)


def calibration_of(target: str, draft: str | None, target_quant: str = "none") -> Callable[[float], Rule]:
    """The stored MARS setting of the pair named so, for a temperature: what :func:`settle` reads for
    ``theta="auto"``, available by name so a command can refuse a missing one before loading weights."""

    def calibrated(temperature: float) -> Rule:
        assert draft is not None  # settle refuses a lossy rule without a drafter first
        return load_choice(target, draft, temperature, target_quant)

    return calibrated


def check_seed(seed: object) -> None:
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64
    ):
        raise MarspecError(f"seed must be an integer that fits in 64 bits, got {seed!r}")


def stop_strings(stop: Sequence[str] | str | None) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings, or the one-line error."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stops):
        raise MarspecError("stop strings must be non-empty strings")
    return stops
