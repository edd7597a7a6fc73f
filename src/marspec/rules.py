"""The accept rule as one typed value: its names (:class:`RuleName`, :class:`Margin`, :class:`Guard`),
what ``theta`` means under each rule (:data:`THETA_MEANINGS`) and :class:`Rule`, whose ranges are checked
here and nowhere else. The table (names, ranges, which guard goes with which rule) is built from the rule
families (:mod:`marspec.families`, one file each), which state those facts; a Rule answers for its own
with :attr:`Rule.family`.

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
from dataclasses import dataclass

from marspec.errors import MarspecError
from marspec.families import FAMILIES, Family
from marspec.families.base import (
    LOGITS,
    NATS,
    PROBABILITY,
    RANK,
    RATIO,
    WEIGHT,
    SettingName,
    ThetaMeaning,
)
from marspec.families.fly import FLY_MAX_ENTROPY, FLY_TOP
from marspec.families.guards import GUARDS, TREE_REFUSALS, Guard
from marspec.families.mars import MARGINS, Margin

__all__ = [
    "AUTO",
    "FAMILIES",
    "FLY_MAX_ENTROPY",
    "FLY_TOP",
    "GUARDED_RULES",
    "GUARDS",
    "LOGITS",
    "LOSSLESS_RULES",
    "MARGINS",
    "NATS",
    "PROBABILITY",
    "RANK",
    "RATIO",
    "RIVALS",
    "RULES",
    "THETA_MEANINGS",
    "WEIGHT",
    "Guard",
    "Margin",
    "Rule",
    "RuleName",
    "SettingName",
    "ThetaMeaning",
    "parse_theta",
    "rule_family",
    "theta_meaning",
    "theta_table",
    "uses_drafter",
]

# theta="auto": the margin and theta `marspec calibrate` stored for a model pair (marspec.calibration),
# resolved by marspec.settings.settle with the loaded pair, so a Rule never holds it.
AUTO = "auto"

# Each name's family, in the order the families list them (the order users see in messages and help).
_FAMILY_OF: dict[str, Family] = {name: family for family in FAMILIES for name in family.names}


class _RuleNameBase(SettingName):
    """:class:`RuleName`'s behaviour: its members are the families' names, so they are added below."""

    @property
    def family(self) -> Family:
        """The family this rule belongs to (:mod:`marspec.families`)."""
        return _FAMILY_OF[self.value]

    @property
    def lossless(self) -> bool:
        """Whether the rule returns the target's own decoding, so theta and margin mean nothing to it."""
        return self.family.lossless


# How draft tokens are accepted: every family's names (RuleName.MARS == "mars", ...). ``plain`` decodes
# without a drafter, so it verifies nothing: it is a generation option, never a Rule's name (RULES).
RuleName: type[_RuleNameBase] = _RuleNameBase(  # type: ignore[call-overload]
    "RuleName", [(name.upper(), name) for name in _FAMILY_OF], module=__name__
)


def rule_family(name: str) -> Family:
    """The family of rule ``name`` (a known one: :class:`Rule` and :meth:`RuleName.parse` check names)."""
    return _FAMILY_OF[name]


def uses_drafter(name: object) -> bool:
    """Whether decoding with rule ``name`` drafts (all but ``plain``; an unset rule is the default, which
    is a Rule's; a name not yet checked is treated as one, and refused where it is checked)."""
    family = _FAMILY_OF.get(name) if isinstance(name, str) else None
    return family is None or family.verifies


# What a Rule may be named: every name of a family that verifies (every RuleName but plain).
RULES: tuple[_RuleNameBase, ...] = tuple(RuleName(n) for n, f in _FAMILY_OF.items() if f.verifies)
# The rivals relax by a test on the target's distribution rather than on MARS's top-2 margin; theta is
# their parameter.
RIVALS: tuple[_RuleNameBase, ...] = tuple(n for n in RULES if not n.family.margin_theta)
LOSSLESS_RULES: tuple[_RuleNameBase, ...] = tuple(n for n in RuleName if n.lossless)
# The relaxing rules each guard narrows (each family names its guards). A lossless rule takes any guard:
# it never relaxes, so there is nothing to narrow.
GUARDED_RULES: dict[Guard, tuple[_RuleNameBase, ...]] = {
    guard: tuple(n for n in RULES if not n.lossless and guard in n.family.guards) for guard in GUARDS
}
# theta per rule, the one statement of it: (rule, margin) where theta is a margin threshold, (rule, None)
# for a rival. Each family states its own.
THETA_MEANINGS: dict[tuple[_RuleNameBase, Margin | None], ThetaMeaning] = {
    (RuleName(name), None if margin is None else Margin(margin)): meaning
    for family in FAMILIES
    for (name, margin), meaning in family.thetas.items()
}


def theta_table() -> str:
    """:data:`THETA_MEANINGS` as the Markdown table docs/rules.md shows (tests/test_rules.py keeps the
    two the same)."""
    rows = [
        "| rule | margin | relaxes where | theta's unit | valid theta | never relaxes at |",
        "|---" * 6 + "|",
    ]
    for (name, margin), m in THETA_MEANINGS.items():
        if name.lossless:
            continue  # never relaxes; a theta it is given is checked as MARS's on its margin
        high = "inf)" if m.high == math.inf else f"{m.high:g}]"
        valid = f"{'an integer in ' if m.integer else ''}{'(' if m.low_open else '['}{m.low:g}, {high}"
        rows.append(
            f"| `{name}` | {f'`{margin}`' if margin else '-'} | {m.test} | {m.unit} | {valid} | {m.never} |"
        )
    return "\n".join(rows)


def theta_meaning(name: str, margin: Margin | None) -> ThetaMeaning:
    """What theta is under rule ``name`` (with ``margin``, where theta is a margin threshold: MARS's, and
    the lossless rules', which check a theta they are given as MARS's on that margin)."""
    return rule_family(name).theta_meaning(name, margin)


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
        family = name.family
        if name not in GUARDED_RULES[guard] and not family.lossless:
            takers = ", ".join(f"{g}" for g in GUARDS if name in GUARDED_RULES[g])
            owner = "is MARS's" if guard is Guard.NEXT else "does not apply to it"
            raise MarspecError(f"the {guard!r} guard {owner}; rule {name!r} takes guard {takers}")
        if family.needs_margin and margin is None:
            raise MarspecError(
                f"rule {name!r} needs a margin; use one of: {', '.join(MARGINS)}", field="margin"
            )
        self._check_theta(name, margin)
        family.check(self)
        if self.window is not None:
            object.__setattr__(self, "window", int(self.window))

    @property
    def family(self) -> Family:
        """The family of this rule's name (:mod:`marspec.families`): its tests and needs."""
        return self.name.family  # type: ignore[attr-defined]  # a RuleName once constructed

    def _check_theta(self, name: _RuleNameBase, margin: Margin | None) -> None:
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
            if not name.family.margin_theta:
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

    def check_tree(self) -> None:
        """Refuse token-tree drafting where this rule judges a chain: a guard that reads along one chain
        (``next``, ``thinking``), or a family that does (FLy's window, the ensemble's draft
        distributions)."""
        refusal = TREE_REFUSALS.get(self.guard) or self.family.tree_refusal
        if refusal:
            raise MarspecError(refusal)

    @property
    def relaxes(self) -> bool:
        """Whether this rule can ever accept a non-top-1 token (False for strict and a theta that never
        relaxes, :attr:`ThetaMeaning.never`)."""
        return self.family.relaxes(self)
