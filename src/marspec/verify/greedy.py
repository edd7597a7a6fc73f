"""Greedy (temperature 0) verification of a chain of draft tokens: :func:`verify_greedy`.

An exact match to the target's top-1 is accepted; beyond it the rule's relaxed accepts
(:mod:`marspec.verify.relax`), or the ensemble's mixture (:mod:`marspec.verify.ensemble`). The decode
step calls it at temperature 0 with the target's logits for ``prefix + draft``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from marspec.rules import Rule
from marspec.verify.chain import Verification, _check_block, _leading_true, _read_back
from marspec.verify.ensemble import ensemble_choices
from marspec.verify.margins import margin_measure, top2
from marspec.verify.relax import guarded, rule_relaxes
from marspec.verify.top_tokens import argmax

if TYPE_CHECKING:
    from marspec.thinking import ThinkingSpan


def verify_greedy(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    rule: Rule,
    relaxable: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    span: ThinkingSpan | None = None,
) -> Verification:
    """Greedy (temperature 0) verification: exact match, plus the rule's relaxed accepts (MARS's top-2
    on close calls, a rival's test, FLy's deferral), narrowed by its guard.

    ``target_logits``: ``[K+1, V]``; ``draft_tokens``: ``long[K]`` (``K`` may be 0); ``relaxable``:
    the ``class`` guard's table, ``span`` the ``thinking`` guard's (see :func:`guarded`);
    ``draft_probs``: ``[K, V]``, the drafter's distribution at temperature 1, which only the
    ``ensemble`` rule reads (it judges each position by the argmax of the target's and the draft's
    mixture: :func:`ensemble_choices`; a draft without one, a lookup drafter's copy, is verified
    strictly). With a rule that cannot relax, the emitted tokens are exactly those of plain greedy
    decoding.
    """
    k = _check_block(target_logits, draft_tokens)
    if k == 0 and not (rule.family.needs_draft_probs and rule.relaxes and draft_probs is not None):
        return _no_draft(target_logits)
    values, tokens = top2(target_logits)  # [K+1, 2], [K+1, 2]
    values = values.float()
    z1, z2 = values[:k, 0], values[:k, 1]  # [K]
    v1 = tokens[:, 0]  # [K+1]
    draft = draft_tokens.to(device=tokens.device, dtype=tokens.dtype)  # [K]
    margins = margin_measure(z1, z2, rule.margin)
    if rule.family.needs_draft_probs and rule.relaxes and draft_probs is not None:
        choice = ensemble_choices(target_logits, draft_probs, v1, rule, relaxable, span)  # [K+1]
        n = _leading_true(draft == choice[:k])
        relaxed = (draft == choice[:k]) & (choice[:k] != v1[:k])
        return _read_back(n, choice.index_select(0, n.view(1)), draft, relaxed, margins, v1[:k])

    exact = draft == v1[:k]  # [K]
    relaxed = rule_relaxes(target_logits[:k], values[:k], tokens[:k], draft, exact, rule) & ~exact  # [K]
    relaxed = guarded(relaxed, draft, v1[:k], rule, relaxable, span)
    n = _leading_true(exact | relaxed)  # 0-dim long
    return _read_back(n, v1.index_select(0, n.view(1)), draft, relaxed, margins, v1[:k])


def _no_draft(target_logits: torch.Tensor) -> Verification:
    """The verdict on an empty draft (a plain step, or a batch's sequence drafting nothing): the target's
    top token, what the general path takes there (its top-2's first is the argmax), without the ~20
    operators and the six-part read-back that a draft's positions need: one argmax, one host read."""
    return Verification(
        n_accepted=0,
        next_token=int(argmax(target_logits[0]).cpu()),  # the step's one read of the device
        relaxed=torch.zeros(0, dtype=torch.bool),
        margins=torch.zeros(0, dtype=torch.float32),
        top1=torch.zeros(0, dtype=torch.long),
    )
