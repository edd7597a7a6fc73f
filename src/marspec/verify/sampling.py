"""Speculative sampling (temperature > 0) of a chain of draft tokens: :func:`verify_sampling`.

The Leviathan/Chen test, lossless, plus the rule's relaxed accepts (:mod:`marspec.verify.relax`, or the
ensemble's mixture test, :mod:`marspec.verify.ensemble`); a rule whose family judges the block hands it to
:func:`marspec.verify.block.verify_block`. The decode step calls it at temperature > 0 with the target's
logits for ``prefix + draft``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from marspec.rules import Rule
from marspec.verify.block import verify_block
from marspec.verify.chain import (
    Verification,
    _check_sampling,
    _leading_true,
    _read_back,
    _sample,
    finite_flag,
)
from marspec.verify.ensemble import ensemble_relaxes
from marspec.verify.margins import margin_measure, top2
from marspec.verify.relax import guarded, rule_relaxes

if TYPE_CHECKING:
    from marspec.thinking import ThinkingSpan


def verify_sampling(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    rule: Rule,
    temperature: float,
    generator: torch.Generator | None = None,
    relaxable: torch.Tensor | None = None,
    span: ThinkingSpan | None = None,
) -> Verification:
    """Sampling verification: lossless speculative sampling, plus the rule's deterministic relaxed accepts.

    ``target_logits``: ``[K+1, V]``; ``draft_tokens``: ``long[K]``; ``draft_probs``: ``[K, V]``, the
    distribution q the drafter really sampled each draft token from, or None for a deterministic drafter
    (n-gram lookup), meaning q is one-hot at the draft token.

    At a close call (measured on the temperature-scaled logits) a draft token that is the target's top-1 or
    top-2 is accepted without a random draw and counted as relaxed: that is where MARS is lossy. Every
    other position uses the Leviathan/Chen test (accept iff ``u < min(1, p(d)/q(d))``), a rejection emits
    a token from ``norm(max(0, p - q))`` and a full accept a bonus token from ``p``; so with a rule that
    cannot relax the output distribution is exactly the target's. All randomness comes from ``generator``:
    K+1 uniforms drawn at once. A rival's test replaces the close call the same way; FLy instead accepts
    a draft token that failed the random test where :func:`fly_defers` says so (the next ``window``
    draft tokens passed theirs). The ``ensemble`` rule's test is speculative sampling against the
    mixture ``v = theta * p + (1 - theta) * q``: accept iff ``u < min(1, v(d)/q(d))``; a rejection's
    residual ``norm(max(0, v - q)) = norm(max(0, p - q))`` and the bonus ``p`` are strict's, so its
    relaxed accepts are those the mixture passes and strict's test does not. ``relaxable`` and ``span``:
    the guards' inputs (see :func:`guarded`). ``rule="block"`` is :func:`verify_block`. A draft without
    a distribution (a lookup drafter's copy) gives the ensemble nothing to mix: strict there.
    """
    if rule.family.judges_block:
        return verify_block(target_logits, draft_tokens, draft_probs, temperature, generator, rule)
    k = _check_sampling(target_logits, draft_tokens, draft_probs, temperature)
    vocab = target_logits.shape[1]
    device = target_logits.device
    p = torch.softmax(target_logits.float() / temperature, dim=-1)  # [K+1, V]
    draft = draft_tokens.to(device=device, dtype=torch.long)  # [K]

    values, tokens = top2(target_logits[:k])  # [K, 2], [K, 2]
    scaled = values.float() / temperature  # [K, 2]
    z1, z2 = scaled.unbind(-1)  # [K], [K]
    u = torch.rand(k + 1, generator=generator, device=device)  # [K+1]: K accept tests, 1 token draw
    p_d = p[:k].gather(1, draft[:, None])[:, 0]  # [K]
    if draft_probs is None:
        passed = u[:k] < p_d  # q(d) = 1
    else:
        q = draft_probs.to(device=device, dtype=torch.float32)  # [K, V]
        q_d = q.gather(1, draft[:, None])[:, 0]  # [K]
        # u < min(1, p/q) written as u * q < p: no division, and q(d) = 0 < p(d) accepts as it should.
        passed = u[:k] * q_d < p_d
    if rule.family.needs_draft_probs and rule.relaxes and draft_probs is not None:
        relaxed = ensemble_relaxes(u[:k], p_d, q_d, passed, rule)  # [K]
    else:
        relaxed = rule_relaxes(target_logits[:k], scaled, tokens, draft, passed, rule, temperature)  # [K]
    # The guards' reads (an argmax row over [K, V] is already in tokens) are paid only when asked for.
    relaxed = guarded(relaxed, draft, tokens[:, 0], rule, relaxable, span)
    n = _leading_true(relaxed | passed)  # 0-dim long

    # Row n of max(0, p - q), with q = 0 at the bonus row K: the correction residual or the bonus p.
    p_n = p.index_select(0, n.view(1))[0]  # [V]
    if k == 0:
        weights = p_n
    else:
        rejected = (n < k).float()  # 0-dim; row K has no q to subtract
        row = n.clamp(max=k - 1).view(1)
        if draft_probs is None:
            d_n = draft.index_select(0, row)  # [1]
            q_n = (torch.arange(vocab, device=device) == d_n).float()  # [V], one-hot
        else:
            q_n = q.index_select(0, row)[0]  # [V]
        residual = (p_n - rejected * q_n).clamp(min=0.0)  # [V]
        # An all-zero residual (p_n == q_n) cannot follow a genuine rejection; fall back to p_n anyway.
        weights = torch.where(residual.sum() > 0, residual, p_n)
    token = _sample(weights, u[k])
    margins = margin_measure(z1, z2, rule.margin)
    return _read_back(n, token, draft, relaxed, margins, tokens[:, 0], finite_flag(p))
