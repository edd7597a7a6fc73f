"""How close the target's top two are: its top-2, MARS's margins and MARS's close-call test.

MARS (docs/method.md) also accepts a draft token that is the target's second choice when the target is
nearly indifferent between its top two ("close call"). How close is measured by a margin:

- ``logit_ratio`` (the paper's default): ``z2 / z1 > theta``, only when ``z1 > 0``;
- ``prob_ratio``: ``p2 / p1 = exp((z2 - z1) / T) > theta``;
- ``logit_gap``: ``z1 - z2 < theta``.

Every verifier reads :func:`top2` and records :func:`margin_measure` for statistics, whatever its rule,
and the vLLM plugin's batch rule tests close calls with :func:`close_call_accepts`: one module for what
they all share keeps a margin's definition in one place.
"""

from __future__ import annotations

import math

import torch

from marspec.rules import Margin, Rule
from marspec.verify.top_tokens import top2 as top2  # every verifier's, defined there


def margin_measure(
    z1: torch.Tensor, z2: torch.Tensor, margin: Margin | None, temperature: float = 1.0
) -> torch.Tensor:
    """The raw margin between the top-2 logits ``z1 >= z2`` (same shape as ``z1``).

    ``logit_ratio``: ``z2 / z1`` (scale-free, so temperature does not matter; meaningless when
    ``z1 <= 0``); ``prob_ratio``: ``p2 / p1 = exp((z2 - z1) / temperature)``; ``logit_gap``: ``z1 - z2``
    (in the units of the logits given: pass temperature-scaled logits to measure the scaled gap). None
    (a strict or rival rule that names no margin): NaN, nothing measured.
    """
    if margin is None:
        return torch.full_like(z1, math.nan)
    if margin == "logit_ratio":
        return z2 / z1
    if margin == "prob_ratio":
        return torch.exp((z2 - z1) / temperature)
    if margin == "logit_gap":
        return z1 - z2
    Margin.parse(margin, "margin")  # every known margin returned above: this raises, naming them
    raise AssertionError(margin)


def is_close_call(z1: torch.Tensor, z2: torch.Tensor, rule: Rule, temperature: float = 1.0) -> torch.Tensor:
    """Bool tensor (shape of ``z1``): True where ``rule`` treats the top-2 logits as a close call.

    Always False for a rule that cannot relax. For ``logit_ratio`` it also requires ``z1 > 0``: with a
    non-positive top logit the ratio is >= 1 for every gap, so its meaning inverts and we never relax.
    """
    if not rule.relaxes:
        return torch.zeros_like(z1, dtype=torch.bool)
    measure = margin_measure(z1, z2, rule.margin, temperature)
    if rule.margin == "logit_ratio":
        return (z1 > 0) & (measure > rule.theta)
    if rule.margin == "prob_ratio":
        return measure > rule.theta
    return measure < rule.theta


def close_call_accepts(
    top_values: torch.Tensor, top_tokens: torch.Tensor, draft_tokens: torch.Tensor, rule: Rule
) -> torch.Tensor:
    """Bool ``[N]``: where MARS accepts a draft token because the target's top two are a close call.

    Row-wise over ``N`` independent positions (no block structure, so a batch of ragged blocks can be
    passed flattened): the draft token is the target's top-1 or top-2 (``top_tokens``, ``long[N, 2]``
    from :func:`top2`) and ``rule`` finds ``top_values`` (``[N, 2]``, already divided by the temperature
    when sampling) a close call. This is the whole of MARS's relaxation; callers decide what a top-1
    accept means (greedy: an exact match, counted separately; sampling: it skips the random test).
    """
    z1, z2 = top_values.float().unbind(-1)  # [N], [N]
    in_top2 = (top_tokens == draft_tokens.to(top_tokens.dtype)[:, None]).any(-1)  # [N]
    return in_top2 & is_close_call(z1, z2, rule)
