"""``ensemble`` (DIVERSED's static ensemble, as transformers' ``assistant_ensemble_weight``): a draft
token is judged by the mixture ``v = theta * p + (1 - theta) * q`` of the target's ``p`` and the draft's
``q``. It needs the draft's distribution, which only the verifiers have (a lookup drafter's copy has none:
verified strictly there), so its row test relaxes nothing and its two decisions are the verifiers' to
call: greedy, :func:`ensemble_choices`; sampled, :func:`ensemble_relaxes`. A tree's siblings have no
draft distribution, so not in a tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from marspec.families.base import WEIGHT, Family, Setting, ThetaMeaning, ThetaTable
from marspec.families.guards import guarded

if TYPE_CHECKING:
    import torch

    from marspec.thinking import ThinkingSpan


class Ensemble(Family):
    names = ("ensemble",)
    margin_theta = False
    needs_draft_probs = True
    # "class" reads a relaxed draft token and the top-1 it replaced, while the ensemble also changes the
    # correction token.
    guards = ("none", "thinking")
    tree_refusal = (
        "the ensemble mixes the draft's distribution at each chain position; a tree's siblings have none: "
        "drop the tree"
    )

    thetas: ClassVar[ThetaTable] = {
        ("ensemble", None): ThetaMeaning(
            "d passes against theta * p + (1 - theta) * q, q the draft's distribution",
            WEIGHT,
            0.0,
            1.0,
            False,
            "theta = 1",
            "use a weight in (0, 1] (verify against theta * p_target + (1 - theta) * q_draft; 1 never "
            "relaxes, 0 would ignore the target)",
            low_open=True,
        )
    }

    def relaxes(self, rule: Setting) -> bool:
        return rule.theta is not None and rule.theta < 1.0  # a weight of 1 is the target alone


ENSEMBLE = Ensemble()


def ensemble_choices(
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor,
    top1: torch.Tensor,
    rule: Setting,
    relaxable: torch.Tensor | None = None,
    span: ThinkingSpan | None = None,
) -> torch.Tensor:
    """Long ``[K+1]``: the token greedy ensemble verification takes at each row: the argmax of ``theta *
    p + (1 - theta) * q``, ``p`` the target's and ``q`` the draft's distributions at temperature 1, where
    the rule's guard lets that choice stand in for the target's ``top1`` (long ``[K+1]``), else ``top1``.
    The bonus row ``K`` has no draft distribution: the target's top-1, as in transformers. A draft is
    accepted where it equals the choice; the first that does not is replaced by it."""
    import torch

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
    u: torch.Tensor, p_d: torch.Tensor, q_d: torch.Tensor, passed: torch.Tensor, rule: Setting
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
