"""The accept rule as one typed value: its names (:class:`RuleName`, :class:`Margin`, :class:`Guard`) and
:class:`Rule`, validated here and nowhere else.

Every layer turns a user's settings into a :class:`Rule` through this module: the library's
``GenerationOptions`` (and through it the CLI and the server) with :meth:`Rule.of`, the bench's method
names (``eval.methods``), the vLLM plugin's ``additional_config`` and a stored calibration with
``Rule(...)``. So the names, the ranges of ``theta`` and ``window``, which guard goes with which rule,
and the one-line errors that name the fix live in one place (docs/architecture.md, "Settings").

Strings stay accepted wherever users write them (``rule="mars"``, ``--margin logit_gap``, JSON): the names
are :class:`~enum.StrEnum` members, so they compare, hash, format and serialise as the plain string.
Free of torch, so the CLI can check settings before loading anything.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from enum import StrEnum
from typing import Self

from marspec.defaults import DEFAULT_MARGIN, DEFAULT_RULE, FLY_THETA, FLY_WINDOW, default_setting
from marspec.errors import MarspecError

# theta="auto": the margin and theta `marspec calibrate` stored for a model pair (marspec.calibration),
# resolved per pair by the Decoder, so a Rule never holds it.
AUTO = "auto"


class SettingName(StrEnum):
    """A setting's name. A ``str``, so code and users may keep writing the plain string."""

    def __repr__(self) -> str:
        # Messages and reprs read as what the user typed ('mars'), not <RuleName.MARS: 'mars'>.
        return repr(self.value)

    @classmethod
    def parse(cls, value: object, field: str, choices: tuple[Self, ...] | None = None) -> Self:
        """``value`` as a member of ``choices`` (default: every member), else the one-line error that
        lists them; ``field`` names the option in it (and in ``MarspecError.field``, for the server)."""
        allowed = tuple(cls) if choices is None else choices
        if isinstance(value, str) and value in allowed:
            return cls(value)
        raise MarspecError(f"unknown {field} {value!r}; use one of: {', '.join(allowed)}", field=field)


class RuleName(SettingName):
    """How draft tokens are accepted. ``plain`` decodes without a drafter, so it verifies nothing: it is a
    generation option, never a :class:`Rule`'s name (:data:`RULES`)."""

    PLAIN = "plain"
    STRICT = "strict"
    MARS = "mars"
    TYPICAL = "typical"
    PTHRESH = "pthresh"
    TOPK = "topk"
    FLY = "fly"

    @property
    def lossless(self) -> bool:
        """Whether the rule returns the target's own decoding, so theta and margin mean nothing to it."""
        return self in LOSSLESS_RULES


class Margin(SettingName):
    """MARS's measure of how close the target's top two are (see :mod:`marspec.verify`)."""

    LOGIT_RATIO = "logit_ratio"  # the paper's z2 / z1
    PROB_RATIO = "prob_ratio"  # p2 / p1
    LOGIT_GAP = "logit_gap"  # z1 - z2

    @property
    def is_ratio(self) -> bool:
        """A ratio at most 1 between the top two: theta is a threshold in [0, 1]."""
        return self is not Margin.LOGIT_GAP


class Guard(SettingName):
    """What narrows a rule's relaxed accepts."""

    NONE = "none"
    # "next" (our variant, not the paper's): a close call is relaxed only where the draft's next token is
    # the target's top choice after the relaxed token, read from the same verification forward. The last
    # draft position has no next draft token, so it is never relaxed under this guard.
    NEXT = "next"
    # "class" (ours): a relaxed accept only where the draft token and the top-1 it replaces are both of
    # the token classes measured harmless (marspec.defaults.GUARD_CLASSES, docs/rules.md).
    CLASS = "class"


# What a Rule may be named: every RuleName but plain.
RULES: tuple[RuleName, ...] = tuple(n for n in RuleName if n is not RuleName.PLAIN)
# The rivals relax by a test on the target's distribution rather than on MARS's top-2 margin; theta is
# their parameter, and it has no default except FLy's.
RIVALS: tuple[RuleName, ...] = (RuleName.TYPICAL, RuleName.PTHRESH, RuleName.TOPK, RuleName.FLY)
LOSSLESS_RULES: tuple[RuleName, ...] = (RuleName.PLAIN, RuleName.STRICT)
MARGINS: tuple[Margin, ...] = tuple(Margin)
GUARDS: tuple[Guard, ...] = tuple(Guard)
# The relaxing rules each guard narrows ("next" reads MARS's close calls along a chain). A lossless rule
# takes any guard: it never relaxes, so there is nothing to narrow.
GUARDED_RULES: dict[Guard, tuple[RuleName, ...]] = {
    Guard.NONE: (RuleName.MARS, *RIVALS),
    Guard.NEXT: (RuleName.MARS,),
    Guard.CLASS: (RuleName.MARS, *RIVALS),
}
_RIVAL_PARAMETERS = {
    RuleName.TYPICAL: "eps in [0, 1] (accept p(d) > min(eps, sqrt(eps) * exp(-entropy)); 0 never relaxes)",
    RuleName.PTHRESH: "a probability in [0, 1] (accept p(d) >= theta; 1 never relaxes)",
    RuleName.TOPK: "an integer k >= 1 (accept a draft among the target's top k; 1 never relaxes)",
    RuleName.FLY: "an entropy threshold >= 0 in nats (defer a mismatch where the target's top-3 entropy is "
    "at least theta; above ln 3 = 1.0986 never relaxes)",
}
# FLy's entropy is over the target's three most likely tokens (the source's choice), so it is <= ln 3.
FLY_TOP = 3
FLY_MAX_ENTROPY = math.log(FLY_TOP)


def rule_name(rule: object, theta: object = None, margin: object = None) -> RuleName:
    """The rule to decode with: ``rule`` when one is named, else :data:`marspec.defaults.DEFAULT_RULE`.

    With no rule named, a ``theta`` or ``margin`` is refused rather than ignored or taken to mean MARS:
    they tune a lossy rule, and either guess would change what the caller gets without saying so."""
    if rule is None:
        if theta is not None or margin is not None:
            pairs = (("theta", theta), ("margin", margin))
            given = ", ".join(f"{k}={v!r}" for k, v in pairs if v is not None)
            raise MarspecError(
                f"{given} tunes a lossy rule but no rule is named, and the default rule ({DEFAULT_RULE}) "
                "never relaxes: name one, e.g. rule='mars' (CLI --rule mars, server marspec.rule)",
                field="rule",
            )
        rule = DEFAULT_RULE
    return RuleName.parse(rule, "rule")


def filled_setting(
    rule: RuleName, theta: object, margin: object, temperature: object
) -> tuple[object, object]:
    """``(margin, theta)`` with unset (None) values filled by the measured default for the decoding
    regime (:func:`marspec.defaults.default_setting`); a rival's parameter has no such default, so its
    theta is left as given. Values are not checked here: :class:`Rule` does that."""
    filled_margin, filled_theta = default_setting(temperature, margin, theta)  # type: ignore[arg-type]
    return filled_margin, theta if rule in RIVALS else filled_theta


def parse_theta(text: str | None) -> float | str | None:
    """A ``--theta`` value: a number, ``auto`` for the pair's calibrated setting, or None when unset."""
    if text is None:
        return None
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise MarspecError(
            f"--theta must be a number (e.g. 0.9) or 'auto' (the calibrated setting), got {text!r}",
            field="theta",
        ) from None


@dataclass(frozen=True)
class Rule:
    """How draft tokens are accepted: ``strict`` (exact match / lossless), ``mars`` (margin-aware), or
    a rival lossy rule (``typical``, ``pthresh``, ``topk``, ``fly``). Names may be given as strings;
    the fields hold :class:`RuleName`, :class:`Margin` and :class:`Guard` members once constructed.

    For MARS ``theta`` is the close-call threshold for ``margin``. For the ratio margins it is in
    ``[0, 1]`` and a lower value relaxes more; for ``logit_gap`` it is the largest top-2 logit gap still
    treated as a close call. ``theta`` is validated for ``strict`` too, so a bad value never goes
    unnoticed. For a rival ``theta`` is that rule's parameter (see :mod:`marspec.verify`); ``margin``
    then only names the measure recorded for statistics. ``window`` is FLy's deferral window (the draft
    tokens after a mismatch that must pass the lossless test), an integer >= 1; other rules take none.
    From a user's generation options (an unset rule, ``plain``, a temperature's defaults), build one
    with :meth:`of`.
    """

    name: RuleName = RuleName.MARS
    # Unset (None): for MARS and strict, the margin's threshold when greedy (marspec.defaults): the
    # default setting, or a named margin's own usual one; FLy's source default; the other rivals must be
    # given their parameter.
    theta: float = None  # type: ignore[assignment]
    margin: Margin = DEFAULT_MARGIN  # type: ignore[assignment]  # a string: checked into a Margin below
    guard: Guard = Guard.NONE
    window: int | None = None  # FLy only; unset: the source's default (marspec.defaults.FLY_WINDOW)

    def __post_init__(self) -> None:
        name = RuleName.parse(self.name, "rule", RULES)
        guard = Guard.parse(self.guard, "guard")
        margin = Margin.parse(self.margin, "margin")
        for attr, value in (("name", name), ("guard", guard), ("margin", margin)):
            object.__setattr__(self, attr, value)  # frozen: the checked members replace the strings
        self._check_window()
        theta = self.theta
        if theta is None and name is RuleName.FLY:
            theta = FLY_THETA
        elif theta is None and name not in RIVALS:
            theta = default_setting(0.0, margin)[1]
        is_number = isinstance(theta, numbers.Real) and not isinstance(theta, bool)
        finite = is_number and math.isfinite(float(theta))
        if name in RIVALS:
            if name not in GUARDED_RULES[guard]:
                raise MarspecError(f"the 'next' guard is MARS's; rule {name!r} takes 'class' or none")
            if name is RuleName.TOPK:
                valid = finite and float(theta) >= 1 and float(theta).is_integer()
            elif name is RuleName.FLY:
                valid = finite and float(theta) >= 0.0
            else:
                valid = finite and 0.0 <= float(theta) <= 1.0
            if not valid:
                problem = (
                    f"rule {name!r} needs theta"
                    if theta is None
                    else f"theta={theta!r} is invalid for rule {name!r}"
                )
                raise MarspecError(f"{problem}: use {_RIVAL_PARAMETERS[name]}", field="theta")
        elif margin.is_ratio:
            ratio = "z2/z1" if margin is Margin.LOGIT_RATIO else "p2/p1"
            if not (finite and 0.0 <= float(theta) <= 1.0):
                raise MarspecError(
                    f"theta={theta!r} is invalid for margin {margin!r}: use a finite number in [0, 1] "
                    f"(the closeness threshold on {ratio}; lower relaxes more; theta = 1 can never relax "
                    f"since the ratio is <= 1, i.e. it equals strict verification)"
                )
        elif not (finite and float(theta) >= 0.0):
            raise MarspecError(
                f"theta={theta!r} is invalid for margin 'logit_gap': use a finite number >= 0 "
                f"(the largest gap z1 - z2, in logits, still treated as a close call; 0 never relaxes)"
            )
        # Normalise ints (theta=1) and numpy scalars to a plain float.
        object.__setattr__(self, "theta", float(theta))

    @classmethod
    def of(
        cls,
        rule: object = None,
        theta: object = None,
        margin: object = None,
        guard: object = Guard.NONE,
        window: object = None,
        temperature: object = 0.0,
    ) -> Rule:
        """The rule a user's generation options describe, the one path from options to a Rule: an unset
        ``rule`` is :func:`rule_name`'s, ``plain`` verifies as ``strict`` (it never has a draft to
        verify), unset ``theta``/``margin`` take the measured default for ``temperature``'s regime
        (:func:`filled_setting`), and ``theta="auto"`` (MARS's calibrated setting, resolved per pair by
        the Decoder) is checked as unset."""
        name = rule_name(rule, theta, margin)
        if theta == AUTO:
            if name in RIVALS:
                raise MarspecError(
                    f"theta='auto' is MARS's calibrated setting; give rule {name!r} its parameter as a "
                    "number (see docs/rules.md)",
                    field="theta",
                )
            theta = None
        margin, theta = filled_setting(name, theta, margin, temperature)
        verified = RuleName.STRICT if name is RuleName.PLAIN else name
        return cls(verified, theta, margin, guard, window)  # type: ignore[arg-type]

    def _check_window(self) -> None:
        window = self.window
        if self.name is not RuleName.FLY:
            if window is not None:
                raise MarspecError(f"window is FLy's deferral window; rule {self.name!r} takes none")
            return
        if window is None:
            window = FLY_WINDOW
        if not isinstance(window, numbers.Integral) or isinstance(window, bool) or window < 1:
            raise MarspecError(
                f"window={window!r} is invalid for rule 'fly': use an integer >= 1 (the draft tokens after "
                "a mismatch that must all pass the lossless test for it to be deferred)",
                field="window",
            )
        object.__setattr__(self, "window", int(window))

    def check_tree(self) -> None:
        """Refuse token-tree drafting where this rule judges a chain: the ``next`` guard reads the draft's
        next token, and FLy's window the tokens after a mismatch, along one chain."""
        if self.guard is Guard.NEXT:
            raise MarspecError(
                "the 'next' guard works on draft chains, not token trees: drop the guard or the tree"
            )
        if self.name is RuleName.FLY:
            raise MarspecError("FLy defers along a draft chain, not a token tree: drop the tree")

    @property
    def relaxes(self) -> bool:
        """Whether this rule can ever accept a non-top-1 token (False for strict and degenerate theta)."""
        if self.name is RuleName.STRICT:
            return False
        if self.name is RuleName.TYPICAL:
            return self.theta > 0.0
        if self.name is RuleName.PTHRESH:
            return self.theta < 1.0
        if self.name is RuleName.TOPK:
            return self.theta > 1.0
        if self.name is RuleName.FLY:
            return self.theta <= FLY_MAX_ENTROPY  # the top-3 entropy is at most ln 3
        if self.margin.is_ratio:
            return self.theta < 1.0  # the ratio is <= 1, and the test is strict ">"
        return self.theta > 0.0  # the gap is >= 0, and the test is strict "<"
