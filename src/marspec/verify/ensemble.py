"""The ``ensemble`` rule's two tests: greedy, :func:`ensemble_choices`, and sampled, :func:`ensemble_relaxes`.

Unlike MARS and the rivals (:mod:`marspec.verify.relax`), the ensemble judges a draft token by the
mixture ``v = theta * p + (1 - theta) * q`` of the target's ``p`` and the draft's ``q``, so it needs the
draft's distribution, which only the verifiers have; both of its decisions sit here, side by side, and
the greedy and sampling verifiers call them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from marspec.rules import Rule
from marspec.verify.relax import guarded

if TYPE_CHECKING:
    from marspec.thinking import ThinkingSpan


def ensemble_choices(
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor,
    top1: torch.Tensor,
    rule: Rule,
    relaxable: torch.Tensor | None = None,
    span: ThinkingSpan | None = None,
) -> torch.Tensor:
    """Long ``[K+1]``: the token greedy ensemble verification takes at each row (DIVERSED's static
    ensemble, as transformers' ``assistant_ensemble_weight``): the argmax of ``theta * p + (1 - theta)
    * q``, ``p`` the target's and ``q`` the draft's distributions at temperature 1, where the rule's
    guard lets that choice stand in for the target's ``top1`` (long ``[K+1]``), else ``top1``. The bonus
    row ``K`` has no draft distribution: the target's top-1, as in transformers. A draft accepted where
    it equals the choice; the first that does not is replaced by it."""
    k = target_logits.shape[0] - 1
    if tuple(draft_probs.shape) != (k, target_logits.shape[1]):
        shape = list(draft_probs.shape)
        raise ValueError(f"draft_probs must be [K, V] = [{k}, {target_logits.shape[1]}], got {shape}")
    theta = float(rule.theta)  # type: ignore[arg-type]  # an ensemble Rule always has its weight
    p = torch.softmax(target_logits[:k].float(), dim=-1)  # [K, V]
    mixture = theta * p + (1.0 - theta) * draft_probs.to(device=p.device, dtype=torch.float32)
    mixed = mixture.argmax(dim=-1)  # [K]
    allowed = guarded(torch.ones_like(mixed, dtype=torch.bool), mixed, top1[:k], rule, relaxable, span)
    return torch.cat([torch.where(allowed, mixed, top1[:k]), top1[k:]])


def ensemble_relaxes(
    u: torch.Tensor, p_d: torch.Tensor, q_d: torch.Tensor, passed: torch.Tensor, rule: Rule
) -> torch.Tensor:
    """Bool ``[K]``: where sampled ensemble verification accepts a draft token strict's test rejected.

    Speculative sampling against the mixture ``v``: accept iff ``u < min(1, v(d)/q(d))``, for the
    uniforms ``u``, the target's ``p_d`` and the draft's ``q_d`` at the draft tokens (each ``[K]``), less
    what strict's test ``passed``. A rejection's residual ``norm(max(0, v - q)) = norm(max(0, p - q))``
    and the bonus ``p`` are strict's, so these are the ensemble's only relaxed accepts.
    """
    theta = float(rule.theta)  # type: ignore[arg-type]  # an ensemble Rule always has its weight
    # u < min(1, v(d)/q(d)) with v = theta * p + (1 - theta) * q, without a division.
    return (u * q_d < theta * p_d + (1.0 - theta) * q_d) & ~passed
