"""Where a rule accepts a draft token the lossless test would not: MARS, the rivals, FLy, and the guards.

Every verifier (greedy chain, token tree, sampling) and the vLLM plugin's batch rule ask
:func:`rule_relaxes` (or, row-wise only, :func:`relaxed_accepts`) which draft tokens a rule relaxes, and
narrow them by :func:`guarded`; so each rule's test is written once, here, and a new rule is added here.

The rival lossy rules other engines ship (docs/rules.md states each one's source and where ours differs)
also relax a draft token the target does not rank first, each by its own test on the target's
distribution ``p`` (at temperature 1 when greedy, at T when sampling); ``theta`` is the rule's parameter:

- ``typical`` (Medusa's typical acceptance): ``p(d) > min(eps, sqrt(eps) * exp(-H(p)))``, ``theta = eps``
  in [0, 1]; 0 never relaxes (an off switch of ours: Medusa's formula would accept any ``p(d) > 0``);
- ``pthresh`` (SGLang's single-token threshold): ``p(d) >= theta``, in [0, 1]; 1 never relaxes;
- ``topk`` (TensorRT-LLM's relaxed acceptance, without its delta): ``d`` is among the target's top
  ``theta`` tokens, an integer >= 1; 1 never relaxes.

MARS's own test, the close call, is :func:`marspec.verify.margins.close_call_accepts`.

``fly`` (FLy, Li et al. 2025, arXiv 2511.22972) is a rival of another shape: it does not judge a row
alone. A draft token the lossless test rejects is accepted (deferred) where the target is uncertain
there (the entropy of its three most likely tokens is at least ``theta``, in nats) and the next
``window`` draft tokens, scored after it in the same forward, all pass the lossless test. ``theta`` above
ln 3 (the largest entropy of three probabilities) never relaxes. Its decision needs the block, so it is
:func:`fly_defers`, not :func:`relaxed_accepts`. The ``ensemble`` rule's test reads the draft's
distribution, so it is :mod:`marspec.verify.ensemble`'s.

Guards (:class:`marspec.rules.Guard`) narrow any rule's relaxed accepts: ``next`` (MARS only) and
``class``, which relaxes only where both the draft token and the target's top-1 it replaces are of the
token classes :data:`marspec.defaults.GUARD_CLASSES` (:mod:`marspec.token_classes`), read from a
per-vocabulary table the caller passes as ``relaxable``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from marspec.errors import MarspecError
from marspec.rules import FLY_TOP, Rule
from marspec.verify.margins import close_call_accepts

if TYPE_CHECKING:
    from marspec.thinking import ThinkingSpan


def relaxed_accepts(
    rows: torch.Tensor,
    top_values: torch.Tensor,
    top_tokens: torch.Tensor,
    draft_tokens: torch.Tensor,
    rule: Rule,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Bool ``[N]``: where ``rule`` accepts a draft token whatever the target ranks first (callers mask
    out exact matches). ``rows`` (``[N, V]``) are the target's logits at the ``N`` positions, needed by
    the rivals only; ``top_values``/``top_tokens`` are their :func:`top2` (values already divided by the
    temperature when sampling), which MARS's test reads."""
    if rule.name == "fly":
        raise MarspecError("FLy judges a draft block, not a row: use fly_defers (verify_greedy does)")
    if not rule.relaxes or rule.name == "ensemble":
        # The ensemble's test reads the draft's distribution, which only the verifiers have (where a
        # draft has none, a lookup drafter's copy, it relaxes nothing).
        return torch.zeros(draft_tokens.shape[0], dtype=torch.bool, device=top_tokens.device)
    if rule.name == "mars":
        return close_call_accepts(top_values, top_tokens, draft_tokens, rule)
    draft = draft_tokens.to(device=rows.device, dtype=torch.long)[:, None]  # [N, 1]
    scaled = rows.float() / temperature  # [N, V]
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


def fly_defers(
    rows: torch.Tensor,
    draft_tokens: torch.Tensor,
    native: torch.Tensor,
    rule: Rule,
    temperature: float = 1.0,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool ``[N]``: where FLy accepts a draft token the lossless test rejected (a deferred mismatch).

    ``rows``: ``[N, V]``, the target's logits at the ``N`` draft positions, each scored after the draft
    tokens before it (one verification forward); ``native``: bool ``[N]``, where the lossless test
    passes (greedy: the draft is the target's top-1; sampling: the random test). The positions are
    blocks of consecutive drafts, ``lengths`` (``long[B]``, summing to ``N``) of them, or one block when
    None, so a ragged batch can be passed flattened. A position ``i`` is deferred when it fails the
    lossless test, the target gives the draft token a probability above 0, the entropy of the target's
    three most likely tokens there (at ``temperature``) is at least ``rule.theta``, and the next
    ``rule.window`` draft tokens of its block exist and all pass the lossless test. No host sync.
    """
    n = draft_tokens.shape[0]
    device = rows.device
    if not rule.relaxes or n == 0:
        return torch.zeros(n, dtype=torch.bool, device=device)
    assert rule.window is not None  # Rule sets FLy's window
    window = rule.window
    draft = draft_tokens.to(device=device, dtype=torch.long)
    logp = torch.log_softmax(rows.float() / temperature, dim=-1)  # [N, V]
    top = logp.topk(min(FLY_TOP, logp.shape[-1]), dim=-1).values  # [N, 3]
    # A zero probability adds nothing to the entropy (and 0 * -inf would be nan).
    entropy = -torch.where(top > float("-inf"), top.exp() * top, torch.zeros_like(top)).sum(-1)  # [N]
    possible = logp.gather(1, draft[:, None])[:, 0] > float("-inf")  # [N]
    index = torch.arange(n, device=device)
    if lengths is None:
        remaining = n - 1 - index  # [N]: draft tokens after each position in its block
    else:
        lengths = lengths.to(device=device, dtype=torch.long)
        ends = torch.cumsum(lengths, 0)  # [B]: one past each block's last position
        block = torch.repeat_interleave(torch.arange(lengths.shape[0], device=device), lengths, output_size=n)
        remaining = ends[block] - 1 - index
    # Native passes in (i, i + window], by differences of a running count; only read where the whole
    # window lies in the block, so it never counts across a block's end.
    count = torch.cat([native.new_zeros(1, dtype=torch.long), native.long().cumsum(0)])  # [N+1]
    ahead = count[(index + window + 1).clamp(max=n)] - count[index + 1]  # [N]
    window_passes = (remaining >= window) & (ahead == window)
    return ~native & possible & (entropy >= rule.theta) & window_passes


def rule_relaxes(
    rows: torch.Tensor,
    top_values: torch.Tensor,
    top_tokens: torch.Tensor,
    draft_tokens: torch.Tensor,
    native: torch.Tensor,
    rule: Rule,
    temperature: float = 1.0,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool ``[N]``: where ``rule`` relaxes, whichever shape its decision has: FLy's deferral over
    blocks (:func:`fly_defers`, reading ``native``, where the lossless test passes, and ``lengths``) or
    a row-wise test (:func:`relaxed_accepts`, reading ``top_values``/``top_tokens``). The verifiers and
    the vLLM plugin's batch rule all decide here; callers mask out what the lossless test accepts."""
    if rule.name == "fly":
        return fly_defers(rows, draft_tokens, native, rule, temperature, lengths)
    return relaxed_accepts(rows, top_values, top_tokens, draft_tokens, rule, temperature)


def guarded(
    relaxed: torch.Tensor,
    draft: torch.Tensor,
    top1: torch.Tensor,
    rule: Rule,
    relaxable: torch.Tensor | None = None,
    span: ThinkingSpan | None = None,
) -> torch.Tensor:
    """``relaxed`` (bool ``[K]``) narrowed by ``rule``'s guard. ``draft`` and ``top1`` (``long[K]``,
    the target's top-1 at each draft position) are one chain, so ``top1[1:]`` is the target's choice
    after each draft token, which the ``next`` guard reads. The ``class`` guard reads ``relaxable``
    (bool ``[V]``, :func:`marspec.token_classes.relaxable_table`) at the draft token and at the top-1;
    the ``thinking`` guard reads ``span`` (:meth:`marspec.thinking.ThinkingMarkers.span`)."""
    if rule.guard == "next":
        return relaxed & _guard_allows(draft, top1[1:])
    if rule.guard == "class":
        return relaxed & _class_allows(draft, top1, relaxable)
    if rule.guard == "thinking":
        if span is None:
            raise MarspecError(
                "the 'thinking' guard needs the block's span: pass span=ThinkingMarkers(...).span(draft, "
                "is_open) (Decoder does this)"
            )
        return relaxed & span.allows(draft, top1)
    return relaxed


def _class_allows(draft: torch.Tensor, top1: torch.Tensor, relaxable: torch.Tensor | None) -> torch.Tensor:
    if relaxable is None:
        raise MarspecError(
            "the 'class' guard needs the tokenizer's class table: pass relaxable="
            "marspec.token_classes.relaxable_table(...) (Decoder does this)"
        )
    table = relaxable.to(device=draft.device)
    return table[draft.long()] & table[top1.long()]


def _guard_allows(draft: torch.Tensor, next_top1: torch.Tensor) -> torch.Tensor:
    """Bool ``[K]``: where the ``next`` guard lets a close call relax. ``next_top1`` (``long[K-1]``) is
    the target's top-1 at draft positions 1..K-1, each scored after the draft token before it."""
    k = draft.shape[0]
    allowed = torch.zeros(k, dtype=torch.bool, device=draft.device)
    allowed[: k - 1] = draft[1:] == next_top1.to(draft.dtype)
    return allowed
