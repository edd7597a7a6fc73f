"""The rival lossy rules other engines ship, each relaxing a draft token the target does not rank first
by its own test on the target's distribution ``p`` (at temperature 1 when greedy, at T when sampling);
``theta`` is the rule's parameter (docs/rules.md states each one's source and where ours differs):

- ``typical`` (Medusa's typical acceptance): ``p(d) > min(eps, sqrt(eps) * exp(-H(p)))``, ``theta = eps``
  in [0, 1]; 0 never relaxes (an off switch of ours: Medusa's formula would accept any ``p(d) > 0``);
- ``pthresh`` (SGLang's single-token threshold): ``p(d) >= theta``, in [0, 1]; 1 never relaxes;
- ``topk`` (TensorRT-LLM's relaxed acceptance, without its delta): ``d`` is among the target's top
  ``theta`` tokens, an integer >= 1; 1 never relaxes.

Each reads the target's whole row of logits at a position, and that row alone.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from marspec.families.base import PROBABILITY, RANK, Family, Scores, Setting, ThetaMeaning, ThetaTable

if TYPE_CHECKING:
    import torch

_THETAS: dict[tuple[str, str | None], ThetaMeaning] = {
    ("typical", None): ThetaMeaning(
        "p(d) > min(theta, sqrt(theta) * exp(-entropy))",
        PROBABILITY,
        0.0,
        1.0,
        False,
        "theta = 0",
        "use eps in [0, 1] (accept p(d) > min(eps, sqrt(eps) * exp(-entropy)); 0 never relaxes)",
    ),
    ("pthresh", None): ThetaMeaning(
        "p(d) >= theta",
        PROBABILITY,
        0.0,
        1.0,
        False,
        "theta = 1",
        "use a probability in [0, 1] (accept p(d) >= theta; 1 never relaxes)",
    ),
    ("topk", None): ThetaMeaning(
        "d is among the target's top theta tokens",
        RANK,
        1.0,
        math.inf,
        True,
        "theta = 1",
        "use an integer k >= 1 (accept a draft among the target's top k; 1 never relaxes)",
    ),
}


class Rivals(Family):
    names = ("typical", "pthresh", "topk")
    margin_theta = False
    needs_rows = True
    guards = ("none", "class", "thinking")

    thetas: ClassVar[ThetaTable] = dict(_THETAS)

    def relaxes(self, rule: Setting) -> bool:
        if rule.theta is None:
            return False
        if rule.name == "typical":
            return rule.theta > 0.0
        if rule.name == "topk":
            return rule.theta > 1.0
        return rule.theta < 1.0  # pthresh

    def relaxed(self, scores: Scores, rule: Setting) -> torch.Tensor:
        if not rule.relaxes:
            return super().relaxed(scores, rule)
        import torch

        assert rule.theta is not None  # relaxes: a rival's theta is set
        draft = scores.draft.to(device=scores.rows.device, dtype=torch.long)[:, None]  # [N, 1]
        scaled = scores.rows.float() / scores.temperature  # [N, V]
        if rule.name == "topk":
            # Tokens ranked strictly above the draft token; fewer than k means it is in the top k.
            above = (scaled > scaled.gather(1, draft)).sum(-1)  # [N]
            return above < int(rule.theta)
        logp = torch.log_softmax(scaled, dim=-1)  # [N, V]
        p_d = logp.gather(1, draft)[:, 0].exp()  # [N]
        if rule.name == "pthresh":
            return p_d >= rule.theta
        entropy = -(logp.exp() * logp).sum(-1)  # [N], in nats
        eps = rule.theta
        return p_d > torch.clamp(math.sqrt(eps) * torch.exp(-entropy), max=eps)


RIVALS = Rivals()
