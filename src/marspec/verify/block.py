"""Block verification (Sun et al. 2024): :func:`verify_block` and its weights, :func:`block_acceptance`.

Lossless like strict speculative sampling but judged over the whole block, so it has its own acceptance
arithmetic (weights and stop probabilities, without a loop) that nothing else shares; it never relaxes,
so it reads no rule's test. :func:`marspec.verify.sampling.verify_sampling` hands ``rule="block"`` here.
"""

from __future__ import annotations

import torch

from marspec.rules import Rule
from marspec.verify.chain import Verification, _check_sampling, _read_back, _sample, finite_flag
from marspec.verify.margins import margin_measure, top2


def verify_block(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: float,
    generator: torch.Generator | None = None,
    rule: Rule | None = None,
) -> Verification:
    """Block verification (Sun et al. 2024, arXiv 2403.10444): lossless like :func:`verify_sampling`'s
    strict speculative sampling, but the block is judged jointly, and in expectation it accepts at least
    as many draft tokens (the paper's theorem). Arguments as :func:`verify_sampling`'s; ``rule`` only
    names the margin recorded for statistics (block verification never relaxes).

    With :func:`block_acceptance`'s weights ``w`` and stop probabilities ``h``: draw ``eta_1..eta_K``;
    the accepted count is the largest ``i`` with ``eta_i < h_i`` (0 if none); the next token is drawn
    from ``norm(max(0, w_i * p_i - q_i))`` at that row, or from ``p_K`` (the bonus) when all ``K`` are
    accepted. K+1 uniforms from ``generator``, as in :func:`verify_sampling`.
    """
    k = _check_sampling(target_logits, draft_tokens, draft_probs, temperature)
    device = target_logits.device
    p = torch.softmax(target_logits.float() / temperature, dim=-1)  # [K+1, V]
    draft = draft_tokens.to(device=device, dtype=torch.long)  # [K]
    q = None if draft_probs is None else draft_probs.to(device=device, dtype=torch.float32)
    u = torch.rand(k + 1, generator=generator, device=device)  # [K+1]: K stop tests, 1 token draw
    stop, weight = block_acceptance(p, draft, q)  # [K], [K+1]
    accepts = torch.arange(1, k + 1, device=device) * (u[:k].double() < stop)  # [K]: i where eta_i < h_i
    n = torch.cat([accepts.new_zeros(1), accepts]).max()  # 0-dim long: the largest, 0 if none

    p_n = p.index_select(0, n.view(1))[0]  # [V]
    if k == 0:
        weights = p_n
    else:
        rejected = n < k  # 0-dim bool; the bonus row K has no q to subtract
        row = n.clamp(max=k - 1).view(1)
        if q is None:
            q_n = (torch.arange(p.shape[1], device=device) == draft.index_select(0, row)).float()  # one-hot
        else:
            q_n = q.index_select(0, row)[0]  # [V]
        scale = torch.where(rejected, weight.index_select(0, n.view(1))[0].float(), 1.0)
        residual = (scale * p_n - rejected.float() * q_n).clamp(min=0.0)  # [V]
        weights = torch.where(residual.sum() > 0, residual, p_n)
    token = _sample(weights, u[k])
    values, tokens = top2(target_logits[:k])  # [K, 2], [K, 2]
    z1, z2 = (values.float() / temperature).unbind(-1)
    margin = None if rule is None else rule.margin
    relaxed = torch.zeros(k, dtype=torch.bool, device=device)
    margins = margin_measure(z1, z2, margin)
    return _read_back(n, token, draft, relaxed, margins, tokens[:, 0], finite_flag(p))


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
