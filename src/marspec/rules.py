"""The accept rule as one typed value: its names (:class:`RuleName`, :class:`Margin`, :class:`Guard`),
what ``theta`` means under each rule (:data:`THETA_MEANINGS`) and :class:`Rule`, whose ranges are checked
here and nowhere else.

A :class:`Rule` is a complete setting: it checks its values and never fills one in. Turning a user's
options (an unset rule, ``plain``, an unset theta or margin, ``theta="auto"``) into a Rule is
:func:`marspec.settings.settle`'s job, the one place defaults are filled (docs/architecture.md,
"Settings").

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

from marspec.errors import MarspecError

# theta="auto": the margin and theta `marspec calibrate` stored for a model pair (marspec.calibration),
# resolved by marspec.settings.settle with the loaded pair, so a Rule never holds it.
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
    BLOCK = "block"
    ENSEMBLE = "ensemble"

    @property
    def lossless(self) -> bool:
        """Whether the rule returns the target's own decoding, so theta and margin mean nothing to it."""
        return self in LOSSLESS_RULES


class Margin(SettingName):
    """MARS's measure of how close the target's top two are (see :mod:`marspec.verify.margins`)."""

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
    # "thinking": relax only between a thinking-start and a thinking-end token (a reasoning model's
    # scratch work), never on the markers themselves; the answer after the span is verified strictly.
    THINKING = "thinking"


# What a Rule may be named: every RuleName but plain.
RULES: tuple[RuleName, ...] = tuple(n for n in RuleName if n is not RuleName.PLAIN)
# The rivals relax by a test on the target's distribution rather than on MARS's top-2 margin; theta is
# their parameter.
RIVALS: tuple[RuleName, ...] = (
    RuleName.TYPICAL,
    RuleName.PTHRESH,
    RuleName.TOPK,
    RuleName.FLY,
    RuleName.ENSEMBLE,
)
# Block verification is lossless: under sampling it accepts at least as much as token-by-token
# speculative sampling (a joint test over the block); greedy it is strict.
LOSSLESS_RULES: tuple[RuleName, ...] = (RuleName.PLAIN, RuleName.STRICT, RuleName.BLOCK)
MARGINS: tuple[Margin, ...] = tuple(Margin)
GUARDS: tuple[Guard, ...] = tuple(Guard)
# The relaxing rules each guard narrows ("next" reads MARS's close calls along a chain; "class" reads a
# relaxed draft token and the top-1 it replaced, while the ensemble also changes the correction token).
# A lossless rule takes any guard: it never relaxes, so there is nothing to narrow.
GUARDED_RULES: dict[Guard, tuple[RuleName, ...]] = {
    Guard.NONE: (RuleName.MARS, *RIVALS),
    Guard.NEXT: (RuleName.MARS,),
    Guard.CLASS: (RuleName.MARS, *(r for r in RIVALS if r is not RuleName.ENSEMBLE)),
    Guard.THINKING: (RuleName.MARS, *RIVALS),
}
# FLy's entropy is over the target's three most likely tokens (the source's choice), so it is <= ln 3.
FLY_TOP = 3
FLY_MAX_ENTROPY = math.log(FLY_TOP)


# The units theta is measured in, named so that no reader has to guess which one a number carries.
RATIO = "ratio"  # a quotient of the target's top two (z2/z1 or p2/p1), dimensionless, at most 1
LOGITS = "logits"  # a difference of raw logits (z1 - z2)
PROBABILITY = "probability"  # a probability under the target's distribution
RANK = "rank"  # a whole number of the target's tokens, counted from its top choice
NATS = "nats"  # an entropy, natural log
WEIGHT = "weight"  # the target's share of a mixture with the draft's distribution


@dataclass(frozen=True)
class ThetaMeaning:
    """What ``theta`` is under one rule (and margin, for MARS): stated once, read by :class:`Rule`'s
    checks, by :attr:`Rule.relaxes` and by the docs (docs/rules.md, "What theta means")."""

    test: str  # where the rule relaxes, in terms of theta
    unit: str  # one of RATIO, LOGITS, PROBABILITY, RANK, NATS, WEIGHT
    low: float  # the smallest valid theta (excluded when low_open)
    high: float  # the largest valid theta (math.inf: unbounded)
    integer: bool  # theta must be a whole number
    never: str  # which theta never relaxes (the rule then equals strict)
    use: str  # the fix a range error names
    low_open: bool = False  # theta must be above ``low``, not equal to it

    def valid(self, theta: object) -> bool:
        if not isinstance(theta, numbers.Real) or isinstance(theta, bool) or not math.isfinite(float(theta)):
            return False
        value = float(theta)
        above_low = self.low < value if self.low_open else self.low <= value
        return above_low and value <= self.high and (not self.integer or value.is_integer())


_RATIO_USE = (
    "use a finite number in [0, 1] (the closeness threshold on {ratio}; lower relaxes more; theta = 1 can "
    "never relax since the ratio is <= 1, i.e. it equals strict verification)"
)
# theta per rule, the one statement of it: (rule, margin) for MARS and strict, (rule, None) for a rival.
THETA_MEANINGS: dict[tuple[RuleName, Margin | None], ThetaMeaning] = {
    **{
        (name, Margin.LOGIT_RATIO): ThetaMeaning(
            "z2 / z1 > theta and z1 > 0",
            RATIO,
            0.0,
            1.0,
            False,
            "theta = 1",
            _RATIO_USE.format(ratio="z2/z1"),
        )
        for name in (RuleName.MARS, RuleName.STRICT)
    },
    **{
        (name, Margin.PROB_RATIO): ThetaMeaning(
            "p2 / p1 > theta", RATIO, 0.0, 1.0, False, "theta = 1", _RATIO_USE.format(ratio="p2/p1")
        )
        for name in (RuleName.MARS, RuleName.STRICT)
    },
    **{
        (name, Margin.LOGIT_GAP): ThetaMeaning(
            "z1 - z2 < theta",
            LOGITS,
            0.0,
            math.inf,
            False,
            "theta = 0",
            "use a finite number >= 0 (the largest gap z1 - z2, in logits, still treated as a close call; "
            "0 never relaxes)",
        )
        for name in (RuleName.MARS, RuleName.STRICT)
    },
    (RuleName.TYPICAL, None): ThetaMeaning(
        "p(d) > min(theta, sqrt(theta) * exp(-entropy))",
        PROBABILITY,
        0.0,
        1.0,
        False,
        "theta = 0",
        "use eps in [0, 1] (accept p(d) > min(eps, sqrt(eps) * exp(-entropy)); 0 never relaxes)",
    ),
    (RuleName.PTHRESH, None): ThetaMeaning(
        "p(d) >= theta",
        PROBABILITY,
        0.0,
        1.0,
        False,
        "theta = 1",
        "use a probability in [0, 1] (accept p(d) >= theta; 1 never relaxes)",
    ),
    (RuleName.TOPK, None): ThetaMeaning(
        "d is among the target's top theta tokens",
        RANK,
        1.0,
        math.inf,
        True,
        "theta = 1",
        "use an integer k >= 1 (accept a draft among the target's top k; 1 never relaxes)",
    ),
    (RuleName.FLY, None): ThetaMeaning(
        "the entropy of the target's top 3 >= theta, and the next window drafts pass the lossless test",
        NATS,
        0.0,
        math.inf,
        False,
        "theta > ln 3 = 1.0986",
        "use an entropy threshold >= 0 in nats (defer a mismatch where the target's top-3 entropy is at "
        "least theta; above ln 3 = 1.0986 never relaxes)",
    ),
    (RuleName.ENSEMBLE, None): ThetaMeaning(
        "d passes against theta * p + (1 - theta) * q, q the draft's distribution",
        WEIGHT,
        0.0,
        1.0,
        False,
        "theta = 1",
        "use a weight in (0, 1] (verify against theta * p_target + (1 - theta) * q_draft; 1 never relaxes, "
        "0 would ignore the target)",
        low_open=True,
    ),
}


def theta_table() -> str:
    """:data:`THETA_MEANINGS` as the Markdown table docs/rules.md shows (tests/test_rules.py keeps the
    two the same)."""
    rows = [
        "| rule | margin | relaxes where | theta's unit | valid theta | never relaxes at |",
        "|---" * 6 + "|",
    ]
    for (name, margin), m in THETA_MEANINGS.items():
        if name is RuleName.STRICT:
            continue  # strict never relaxes; a theta it is given is checked as MARS's on its margin
        high = "inf)" if m.high == math.inf else f"{m.high:g}]"
        valid = f"{'an integer in ' if m.integer else ''}{'(' if m.low_open else '['}{m.low:g}, {high}"
        rows.append(
            f"| `{name}` | {f'`{margin}`' if margin else '-'} | {m.test} | {m.unit} | {valid} | {m.never} |"
        )
    return "\n".join(rows)


def theta_meaning(name: RuleName, margin: Margin | None) -> ThetaMeaning:
    """What theta is under rule ``name`` (with ``margin``, for MARS and the lossless rules, which check a
    theta they are given as MARS's on that margin)."""
    if name in RIVALS:
        return THETA_MEANINGS[(name, None)]
    return THETA_MEANINGS[(RuleName.STRICT if name.lossless else name, margin)]  # type: ignore[index]


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
    """How draft tokens are accepted: ``strict`` (exact match / lossless), ``block`` (lossless block
    verification under sampling, strict when greedy), ``mars`` (margin-aware), or a rival lossy rule
    (``typical``, ``pthresh``, ``topk``, ``fly``, ``ensemble``). Names may be given as strings;
    the fields hold :class:`RuleName`, :class:`Margin` and :class:`Guard` members once constructed.

    A complete setting, checked and never filled in: ``Rule()`` is ``strict``, as every entry point's
    unnamed rule is; a relaxing rule needs its ``theta`` (see :data:`THETA_MEANINGS` for its unit and
    range), MARS its ``margin`` and FLy its ``window`` (the draft tokens after a mismatch that must pass
    the lossless test, an integer >= 1; other rules take none). ``margin`` is also the measure recorded
    for statistics under strict and the rivals (None: none recorded). Strict takes a theta only with a
    margin, and checks it there, so a bad value never goes unnoticed. From a user's generation options
    (an unset rule or theta, ``plain``, a temperature's defaults, ``theta="auto"``) a Rule comes from
    :func:`marspec.settings.settle`.
    """

    name: RuleName = RuleName.STRICT
    theta: float | None = None
    margin: Margin | None = None
    guard: Guard = Guard.NONE
    window: int | None = None

    def __post_init__(self) -> None:
        name = RuleName.parse(self.name, "rule", RULES)
        guard = Guard.parse(self.guard, "guard")
        margin = None if self.margin is None else Margin.parse(self.margin, "margin")
        for attr, value in (("name", name), ("guard", guard), ("margin", margin)):
            object.__setattr__(self, attr, value)  # frozen: the checked members replace the strings
        if name not in GUARDED_RULES[guard] and not name.lossless:
            takers = ", ".join(f"{g}" for g in GUARDS if name in GUARDED_RULES[g])
            owner = "is MARS's" if guard is Guard.NEXT else "does not apply to it"
            raise MarspecError(f"the {guard!r} guard {owner}; rule {name!r} takes guard {takers}")
        if name is RuleName.MARS and margin is None:
            raise MarspecError(
                f"rule 'mars' needs a margin; use one of: {', '.join(MARGINS)}", field="margin"
            )
        self._check_theta(name, margin)
        self._check_window()

    def _check_theta(self, name: RuleName, margin: Margin | None) -> None:
        theta = self.theta
        if theta is None and name.lossless:
            return  # a lossless rule never relaxes: nothing to threshold
        if name.lossless and margin is None:
            raise MarspecError(
                f"theta={theta!r} for rule {name!r} needs a margin to be checked against; {name!r} never "
                "relaxes, so leave theta unset",
                field="theta",
            )
        meaning = theta_meaning(name, margin)
        if not meaning.valid(theta):
            if name in RIVALS:
                problem = (
                    f"rule {name!r} needs theta"
                    if theta is None
                    else f"theta={theta!r} is invalid for rule {name!r}"
                )
            else:
                problem = f"theta={theta!r} is invalid for margin {margin!r}"
            raise MarspecError(f"{problem}: {meaning.use}", field="theta")
        # Normalise ints (theta=1) and numpy scalars to a plain float.
        object.__setattr__(self, "theta", float(theta))  # type: ignore[arg-type]

    def _check_window(self) -> None:
        window = self.window
        if self.name is not RuleName.FLY:
            if window is not None:
                raise MarspecError(f"window is FLy's deferral window; rule {self.name!r} takes none")
            return
        if not isinstance(window, numbers.Integral) or isinstance(window, bool) or window < 1:
            problem = (
                "rule 'fly' needs a window"
                if window is None
                else f"window={window!r} is invalid for rule 'fly'"
            )
            raise MarspecError(
                f"{problem}: use an integer >= 1 (the draft tokens after a mismatch that must all pass the "
                "lossless test for it to be deferred)",
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
        if self.guard is Guard.THINKING:
            raise MarspecError(
                "the 'thinking' guard follows its span along a draft chain, not a token tree: drop the "
                "guard or the tree"
            )
        if self.name is RuleName.FLY:
            raise MarspecError("FLy defers along a draft chain, not a token tree: drop the tree")
        if self.name is RuleName.ENSEMBLE:
            raise MarspecError(
                "the ensemble mixes the draft's distribution at each chain position; a tree's siblings "
                "have none: drop the tree"
            )

    @property
    def relaxes(self) -> bool:
        """Whether this rule can ever accept a non-top-1 token (False for strict and a theta that never
        relaxes, :attr:`ThetaMeaning.never`)."""
        if self.name.lossless or self.theta is None:
            return False
        theta = self.theta
        if self.name is RuleName.TYPICAL:
            return theta > 0.0
        if self.name is RuleName.PTHRESH:
            return theta < 1.0
        if self.name is RuleName.TOPK:
            return theta > 1.0
        if self.name is RuleName.ENSEMBLE:
            return theta < 1.0  # a weight of 1 is the target alone
        if self.name is RuleName.FLY:
            return theta <= FLY_MAX_ENTROPY  # the top-3 entropy is at most ln 3
        if self.margin is not None and self.margin.is_ratio:
            return theta < 1.0  # the ratio is <= 1, and the test is strict ">"
        return theta > 0.0  # the gap is >= 0, and the test is strict "<"
