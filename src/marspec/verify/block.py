"""Block verification (Sun et al. 2024): :func:`verify_block`, which draws with its family's weights,
:func:`marspec.families.block.block_acceptance`.

Lossless like strict speculative sampling but judged over the whole block, so it has its own acceptance
arithmetic that nothing else shares; it never relaxes, so it reads no rule's test.
:func:`marspec.verify.sampling.verify_sampling` hands it a block whose rule's family ``judges_block``.
"""

from __future__ import annotations

import torch

from marspec.families.block import block_acceptance as block_acceptance  # its test, in its family's file
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
