"""MARS, the paper's rule (docs/method.md): a draft token that is the target's second choice is accepted
where the target is nearly indifferent between its top two (a "close call").

How close is measured by a margin (:class:`Margin`), and theta is a threshold on it:

- ``logit_ratio`` (the paper's default): ``z2 / z1 > theta``, only when ``z1 > 0``;
- ``prob_ratio``: ``p2 / p1 = exp((z2 - z1) / T) > theta``;
- ``logit_gap``: ``z1 - z2 < theta``.

Every verifier records :func:`margin_measure` for statistics, whatever its rule, so a margin's definition
lives here once; MARS's whole test is :func:`close_call_accepts`, and it reads the target's top two only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from marspec.families.base import (
    LOGITS,
    RATIO,
    Family,
    Scores,
    Setting,
    SettingName,
    ThetaMeaning,
    ThetaTable,
)

if TYPE_CHECKING:
    import torch


class Margin(SettingName):
    """MARS's measure of how close the target's top two are."""

    LOGIT_RATIO = "logit_ratio"  # the paper's z2 / z1
    PROB_RATIO = "prob_ratio"  # p2 / p1
    LOGIT_GAP = "logit_gap"  # z1 - z2

    @property
    def is_ratio(self) -> bool:
        """A ratio at most 1 between the top two: theta is a threshold in [0, 1]."""
        return self is not Margin.LOGIT_GAP


MARGINS: tuple[Margin, ...] = tuple(Margin)

_RATIO_USE = (
    "use a finite number in [0, 1] (the closeness threshold on {ratio}; lower relaxes more; theta = 1 can "
    "never relax since the ratio is <= 1, i.e. it equals strict verification)"
)
# Theta on each margin: MARS's threshold, and how a lossless rule checks a theta it is given.
MARGIN_THETAS: dict[Margin, ThetaMeaning] = {
    Margin.LOGIT_RATIO: ThetaMeaning(
        "z2 / z1 > theta and z1 > 0", RATIO, 0.0, 1.0, False, "theta = 1", _RATIO_USE.format(ratio="z2/z1")
    ),
    Margin.PROB_RATIO: ThetaMeaning(
        "p2 / p1 > theta", RATIO, 0.0, 1.0, False, "theta = 1", _RATIO_USE.format(ratio="p2/p1")
    ),
    Margin.LOGIT_GAP: ThetaMeaning(
        "z1 - z2 < theta",
        LOGITS,
        0.0,
        math.inf,
        False,
        "theta = 0",
        "use a finite number >= 0 (the largest gap z1 - z2, in logits, still treated as a close call; "
        "0 never relaxes)",
    ),
}


def margin_relaxes(theta: float, margin: str | None) -> bool:
    """Whether a close-call threshold ``theta`` on ``margin`` can ever relax."""
    if margin is not None and Margin(margin).is_ratio:
        return theta < 1.0  # the ratio is <= 1, and the test is strict ">"
    return theta > 0.0  # the gap is >= 0, and the test is strict "<"


class Mars(Family):
    names = ("mars",)
    needs_margin = True
    calibrates = True
    guards = ("none", "next", "class", "thinking")

    thetas: ClassVar[ThetaTable] = {("mars", margin): meaning for margin, meaning in MARGIN_THETAS.items()}

    def relaxes(self, rule: Setting) -> bool:
        return rule.theta is not None and margin_relaxes(rule.theta, rule.margin)

    def relaxed(self, scores: Scores, rule: Setting) -> torch.Tensor:
        if not rule.relaxes:
            return super().relaxed(scores, rule)
        return close_call_accepts(scores.top_values, scores.top_tokens, scores.draft, rule)


MARS = Mars()


def margin_measure(
    z1: torch.Tensor, z2: torch.Tensor, margin: str | None, temperature: float = 1.0
) -> torch.Tensor:
    """The raw margin between the top-2 logits ``z1 >= z2`` (same shape as ``z1``).

    ``logit_ratio``: ``z2 / z1`` (scale-free, so temperature does not matter; meaningless when
    ``z1 <= 0``); ``prob_ratio``: ``p2 / p1 = exp((z2 - z1) / temperature)``; ``logit_gap``: ``z1 - z2``
    (in the units of the logits given: pass temperature-scaled logits to measure the scaled gap). None
    (a strict or rival rule that names no margin): NaN, nothing measured.
    """
    import torch

    if margin is None:
        return torch.full_like(z1, math.nan)
    if margin == Margin.LOGIT_RATIO:
        return z2 / z1
    if margin == Margin.PROB_RATIO:
        return torch.exp((z2 - z1) / temperature)
    if margin == Margin.LOGIT_GAP:
        return z1 - z2
    Margin.parse(margin, "margin")  # every known margin returned above: this raises, naming them
    raise AssertionError(margin)


def is_close_call(
    z1: torch.Tensor, z2: torch.Tensor, rule: Setting, temperature: float = 1.0
) -> torch.Tensor:
    """Bool tensor (shape of ``z1``): True where ``rule`` treats the top-2 logits as a close call.

    Always False for a rule that cannot relax. For ``logit_ratio`` it also requires ``z1 > 0``: with a
    non-positive top logit the ratio is >= 1 for every gap, so its meaning inverts and we never relax.
    """
    import torch

    if not rule.relaxes:
        return torch.zeros_like(z1, dtype=torch.bool)
    measure = margin_measure(z1, z2, rule.margin, temperature)
    if rule.margin == Margin.LOGIT_RATIO:
        return (z1 > 0) & (measure > rule.theta)
    if rule.margin == Margin.PROB_RATIO:
        return measure > rule.theta
    return measure < rule.theta


def close_call_accepts(
    top_values: torch.Tensor, top_tokens: torch.Tensor, draft_tokens: torch.Tensor, rule: Setting
) -> torch.Tensor:
    """Bool ``[N]``: where MARS accepts a draft token because the target's top two are a close call.

    Row-wise over ``N`` independent positions (no block structure, so a batch of ragged blocks can be
    passed flattened): the draft token is the target's top-1 or top-2 (``top_tokens``, ``long[N, 2]``)
    and ``rule`` finds ``top_values`` (``[N, 2]``, already divided by the temperature when sampling) a
    close call. This is the whole of MARS's relaxation; callers decide what a top-1 accept means (greedy:
    an exact match, counted separately; sampling: it skips the random test).
    """
    z1, z2 = top_values.float().unbind(-1)  # [N], [N]
    in_top2 = (top_tokens == draft_tokens.to(top_tokens.dtype)[:, None]).any(-1)  # [N]
    return in_top2 & is_close_call(z1, z2, rule)
