"""What every rule family states, and the shape of a setting's name: :class:`Family`, :class:`ThetaMeaning`
and :class:`SettingName`.

A family is one file of :mod:`marspec.families`; this module holds the parts they share, so that the
table :mod:`marspec.rules` builds from them reads the same fields from each. Free of torch: a family's
accept tests import it when they run, so the command line can check a setting without loading it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar, Protocol, Self

from marspec.errors import MarspecError

if TYPE_CHECKING:
    import torch


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


# The units theta is measured in, named so that no reader has to guess which one a number carries.
RATIO = "ratio"  # a quotient of the target's top two (z2/z1 or p2/p1), dimensionless, at most 1
LOGITS = "logits"  # a difference of raw logits (z1 - z2)
PROBABILITY = "probability"  # a probability under the target's distribution
RANK = "rank"  # a whole number of the target's tokens, counted from its top choice
NATS = "nats"  # an entropy, natural log
WEIGHT = "weight"  # the target's share of a mixture with the draft's distribution


@dataclass(frozen=True)
class ThetaMeaning:
    """What ``theta`` is under one rule (and margin, for MARS): stated once in its family's file, read
    by :class:`marspec.rules.Rule`'s checks, by :attr:`Rule.relaxes` and by the docs (docs/rules.md,
    "What theta means")."""

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


# Theta's meaning per (rule name, margin): a family's statement of it.
ThetaTable = Mapping[tuple[str, str | None], ThetaMeaning]


class Setting(Protocol):
    """What a family reads of a rule (:class:`marspec.rules.Rule`, which is built from the families and
    so is not imported by them)."""

    @property
    def name(self) -> str: ...
    @property
    def theta(self) -> float | None: ...
    @property
    def margin(self) -> str | None: ...
    @property
    def guard(self) -> str: ...
    @property
    def window(self) -> int | None: ...
    @property
    def relaxes(self) -> bool: ...


@dataclass(slots=True)  # made once per verification: slots, not frozen, keep that cheap
class Scores:
    """What a verifier hands a family's accept test about ``N`` draft positions (one flattened batch of
    blocks, or one chain): every test reads what it needs of it.

    ``rows``: ``[N, V]``, the target's logits there; ``top_values``/``top_tokens``: their top two
    (``[N, 2]``, values already divided by the temperature when sampling); ``draft``: ``long[N]``, the
    draft tokens; ``native``: bool ``[N]``, where the lossless test passes (greedy: an exact match;
    sampling: the random test); ``lengths``: ``long[B]`` consecutive blocks of the positions (None:
    one block)."""

    rows: torch.Tensor
    top_values: torch.Tensor
    top_tokens: torch.Tensor
    draft: torch.Tensor
    native: torch.Tensor | None = None
    temperature: float = 1.0
    lengths: torch.Tensor | None = None


class Family:
    """One family of accept rules: its names, what theta means under each, whether it is lossless, what
    its test needs, and the test itself. Each family file defines one subclass and one instance of it;
    :data:`marspec.families.FAMILIES` lists them, and :mod:`marspec.rules` builds its table from them.

    The class attributes are the family's facts; the methods its decisions, which a subclass overrides
    where its rules differ from the default (never relaxing, like ``strict``)."""

    names: tuple[str, ...] = ()  # the rule names this family answers for
    lossless: bool = False  # its output is the target's own decoding, so theta and margin mean nothing
    margin_theta: bool = True  # theta is a margin threshold (MARS's, filled from the regime's setting);
    # False for a rival, whose theta is its own parameter (no regime default, no theta="auto")
    needs_margin: bool = False  # a Rule of it names a margin (MARS)
    calibrates: bool = False  # theta="auto" takes the pair's calibrated setting (MARS)
    takes_window: bool = False  # a Rule of it has a window (FLy)
    needs_rows: bool = False  # its test reads the target's whole row of logits, not only its top two
    needs_draft_probs: bool = False  # its test reads the drafter's distribution
    judges_block: bool = False  # it verifies a sampled block with its own arithmetic (block verification)
    guards: tuple[str, ...] = ("none",)  # the guards that may narrow it (a lossless one takes any)
    row_refusal: str | None = None  # why its test cannot judge a row alone, or None when it can
    tree_refusal: str | None = None  # why it cannot judge a token tree, or None when it can
    verifies: bool = True  # False for decoding without a drafter (``plain``)

    # Theta's meaning per (name, margin), margin None for a rival, whose theta is its own: the family's
    # statement of it (a lossless family that checks a theta as MARS's states none of its own).
    thetas: ClassVar[ThetaTable] = {}

    def theta_meaning(self, name: str, margin: str | None) -> ThetaMeaning:
        """What theta is under rule ``name`` (with ``margin``, where theta is a margin threshold)."""
        return self.thetas[(name, margin if self.margin_theta else None)]

    def relaxes(self, rule: Setting) -> bool:
        """Whether ``rule`` (one of this family's) can ever accept a token the lossless test would not."""
        return False

    def check(self, rule: Setting) -> None:
        """Refuse what the common checks of :class:`marspec.rules.Rule` do not cover (a window)."""
        if rule.window is not None:
            raise MarspecError(f"window is FLy's deferral window; rule {rule.name!r} takes none")

    def relaxed(self, scores: Scores, rule: Setting) -> torch.Tensor:
        """Bool ``[N]``: where ``rule`` relaxes at ``scores``'s positions (callers mask out what the
        lossless test accepts). Never, by default."""
        import torch

        return torch.zeros(scores.draft.shape[0], dtype=torch.bool, device=scores.top_tokens.device)
