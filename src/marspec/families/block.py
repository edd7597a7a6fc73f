"""``block``: block verification (Sun et al. 2024, arXiv 2403.10444), lossless like strict speculative
sampling but judged over the whole draft block, so in expectation it accepts at least as many draft
tokens; greedy it is strict. Its test, :func:`block_acceptance`, is acceptance arithmetic of its own
(weights and stop probabilities, without a loop); :func:`marspec.verify.block.verify_block` draws with
it. It never relaxes, so a theta it is given is checked as MARS's on the margin, as ``strict``'s is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from marspec.families.strict import Lossless

if TYPE_CHECKING:
    import torch


class Block(Lossless):
    names = ("block",)
    judges_block = True


BLOCK = Block()


def block_acceptance(
    p: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification's ``(h, w)`` for a draft (float64 ``[K]`` and ``[K+1]``).

    ``p``: the target's distributions ``[K+1, V]`` (row ``i`` after ``draft[:i]``); ``draft``: long
    ``[K]``; ``q``: the draft's distributions ``[K, V]``, or None for a deterministic drafter (q one-hot
    at the draft token). ``w_0 = 1`` and ``w_i = min(1, w_{i-1} * p(d_i) / q(d_i))``: how much of the
    target's probability of the first ``i`` drafts the block still owes. ``h_i`` (for ``i = 1..K``) is the
    probability of stopping after ``i`` drafts once no longer draft did: ``h_K = w_K``, and for ``i < K``
    ``h_i = r_i / (r_i + 1 - w_i)``, ``r_i = sum_x max(0, w_i * p_i(x) - q_i(x))`` the residual mass at row
    ``i`` (0 where both are 0). No loop: ``log w_i = S_i - max_{j <= i} S_j``, ``S`` the running sum of
    the log ratios (``w`` follows a walk capped at 1, i.e. reflected at its running maximum).
    """
    import torch

    k = draft.shape[0]
    p_d = p[:k].gather(1, draft[:, None])[:, 0].double()  # [K]
    if q is None:
        q_d = torch.ones_like(p_d)
    else:
        q_d = q.gather(1, draft[:, None])[:, 0].double().clamp(min=torch.finfo(torch.float64).tiny)
    walk = torch.cat([p_d.new_zeros(1), (p_d.log() - q_d.log()).cumsum(0)])  # [K+1]: S_0 = 0
    weight = torch.exp(walk - torch.cummax(walk, 0).values)  # [K+1], w_0 = 1
    w = weight[:k]  # [K]: rows 0..K-1
    if q is None:
        # sum_x max(0, w * p(x) - [x = d]) = w * (1 - p(d)), since w * p(d) <= 1.
        residual = w * (1.0 - p_d)
    else:
        residual = (w[:, None].float() * p[:k] - q).clamp(min=0.0).sum(-1).double()  # [K]
    denominator = residual + (1.0 - w)
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    stop = torch.where(denominator > 0, residual / safe, torch.zeros_like(residual))  # [K]: h_0..h_{K-1}
    return torch.cat([stop[1:], weight[k:]]), weight
