"""Accept rules for speculative decoding: strict, MARS (margin-aware) and MARS's rivals.

Longer than marspec's other modules on purpose: every rule's test and the three verifiers (greedy chain,
token tree, sampling) share the same loop-free helpers (top-2, margins, leading accepts, the one
read-back), and keeping them side by side lets a reader compare the rules on the same tensors; the
rules' names and settings are checked apart, in ``rules.py``.

Everything here is a small pure function over target logits: no model, no I/O, no Python loop over draft
positions. A decode step calls :func:`verify_greedy` (temperature 0) or :func:`verify_sampling`
(temperature > 0) with the target's logits for ``prefix + draft`` and gets back a :class:`Verification`.

Shapes: ``K`` is the number of draft tokens, ``V`` the vocabulary size. ``target_logits`` is ``[K+1, V]``:
row ``i`` scores draft position ``i`` and row ``K`` is the bonus position.

MARS (docs/method.md) also accepts a draft token that is the target's second choice when the target is
nearly indifferent between its top two ("close call"). How close is measured by a margin:

- ``logit_ratio`` (the paper's default): ``z2 / z1 > theta``, only when ``z1 > 0``;
- ``prob_ratio``: ``p2 / p1 = exp((z2 - z1) / T) > theta``;
- ``logit_gap``: ``z1 - z2 < theta``.

The rival lossy rules other engines ship (docs/rules.md states each one's source and where ours differs)
also relax a draft token the target does not rank first, each by its own test on the target's
distribution ``p`` (at temperature 1 when greedy, at T when sampling); ``theta`` is the rule's parameter:

- ``typical`` (Medusa's typical acceptance): ``p(d) > min(eps, sqrt(eps) * exp(-H(p)))``, ``theta = eps``
  in [0, 1]; 0 never relaxes (an off switch of ours: Medusa's formula would accept any ``p(d) > 0``);
- ``pthresh`` (SGLang's single-token threshold): ``p(d) >= theta``, in [0, 1]; 1 never relaxes;
- ``topk`` (TensorRT-LLM's relaxed acceptance, without its delta): ``d`` is among the target's top
  ``theta`` tokens, an integer >= 1; 1 never relaxes.

``fly`` (FLy, Li et al. 2025, arXiv 2511.22972) is a rival of another shape: it does not judge a row
alone. A draft token the lossless test rejects is accepted (deferred) where the target is uncertain
there (the entropy of its three most likely tokens is at least ``theta``, in nats) and the next
``window`` draft tokens, scored after it in the same forward, all pass the lossless test. ``theta`` above
ln 3 (the largest entropy of three probabilities) never relaxes. Its decision needs the block, so it is
:func:`fly_defers`, not :func:`relaxed_accepts`.

Guards (:class:`marspec.rules.Guard`) narrow any rule's relaxed accepts: ``next`` (MARS only) and
``class``, which relaxes only where both the draft token and the target's top-1 it replaces are of the
token classes :data:`marspec.defaults.GUARD_CLASSES` (:mod:`marspec.token_classes`), read from a
per-vocabulary table the caller passes as ``relaxable``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from marspec.errors import MarspecError
from marspec.rules import FLY_TOP, RIVALS, Margin, Rule, RuleName

if TYPE_CHECKING:
    from marspec.interfaces import DraftTree
    from marspec.thinking import ThinkingSpan


@dataclass(frozen=True)
class Verification:
    """The outcome of verifying one block of ``K`` draft tokens, on the host.

    The verify functions read everything back in one device-to-host copy, so a decode step that reads
    these fields pays no further synchronisation; the tensors here are CPU tensors.
    """

    n_accepted: int  # draft tokens accepted, 0..K
    next_token: int  # correction token (n_accepted < K) or bonus token (n_accepted == K)
    relaxed: torch.Tensor  # bool[n_accepted]: True where that accepted draft token was a relaxed accept
    # float32[K]: the rule's margin measure at each draft position, for statistics (logit_ratio is
    # inf/nan where z1 == 0; the rule itself never relaxes there)
    margins: torch.Tensor
    # long[K]: the target's top-1 at each draft position (what strict would take): where a token was
    # relaxed, the one it replaced. Read only at relaxed positions, for audits.
    top1: torch.Tensor | None = None
    tokens: tuple[int, ...] = ()  # the accepted draft tokens (n_accepted of them)

    @property
    def n_relaxed(self) -> int:
        """How many of the accepted draft tokens were relaxed accepts."""
        return int(self.relaxed.sum())

    def emitted(self) -> list[int]:
        """The tokens this step commits: the accepted draft tokens followed by ``next_token``."""
        return [*self.tokens, self.next_token]


def top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two largest entries of the last dimension: ``(values[..., 2], tokens[..., 2])``.

    The first token is ``torch.argmax`` so it breaks ties exactly like plain greedy decoding; the second
    is the argmax once the first is masked out (on an exact tie it is the other tied token).
    """
    # logits: [..., V]
    v1 = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
    masked = logits.scatter(-1, v1, float("-inf"))
    v2 = masked.argmax(dim=-1, keepdim=True)  # [..., 1]
    tokens = torch.cat([v1, v2], dim=-1)  # [..., 2]
    return logits.gather(-1, tokens), tokens


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
    values, tokens = top2(target_logits)  # [K+1, 2], [K+1, 2]
    values = values.float()
    z1, z2 = values[:k, 0], values[:k, 1]  # [K]
    v1 = tokens[:, 0]  # [K+1]
    draft = draft_tokens.to(device=tokens.device, dtype=tokens.dtype)  # [K]
    margins = margin_measure(z1, z2, rule.margin)
    if rule.name is RuleName.ENSEMBLE and rule.relaxes and draft_probs is not None:
        choice = ensemble_choices(target_logits, draft_probs, v1, rule, relaxable, span)  # [K+1]
        n = _leading_true(draft == choice[:k])
        relaxed = (draft == choice[:k]) & (choice[:k] != v1[:k])
        return _read_back(n, choice.index_select(0, n.view(1)), draft, relaxed, margins, v1[:k])

    exact = draft == v1[:k]  # [K]
    relaxed = rule_relaxes(target_logits[:k], values[:k], tokens[:k], draft, exact, rule) & ~exact  # [K]
    relaxed = guarded(relaxed, draft, v1[:k], rule, relaxable, span)
    n = _leading_true(exact | relaxed)  # 0-dim long
    return _read_back(n, v1.index_select(0, n.view(1)), draft, relaxed, margins, v1[:k])


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


@dataclass(frozen=True)
class TreeVerification(Verification):
    """The outcome of verifying a token tree: ``Verification`` along the accepted path.

    ``path`` lists the accepted nodes root-down (``n_accepted`` of them); ``tokens`` are their tokens.
    ``chain_prefix`` is how many leading path nodes are chain nodes (the draft model's cache holds the
    chain, so that much of it stays valid). ``margins`` are measured at the rows the walk judged: the
    root's and each path node's except a leaf's, so entry ``i`` is where depth ``i + 1`` was decided.
    """

    path: tuple[int, ...] = ()
    chain_prefix: int = 0


def _guard_allows(draft: torch.Tensor, next_top1: torch.Tensor) -> torch.Tensor:
    """Bool ``[K]``: where the ``next`` guard lets a close call relax. ``next_top1`` (``long[K-1]``) is
    the target's top-1 at draft positions 1..K-1, each scored after the draft token before it."""
    k = draft.shape[0]
    allowed = torch.zeros(k, dtype=torch.bool, device=draft.device)
    allowed[: k - 1] = draft[1:] == next_top1.to(draft.dtype)
    return allowed


def verify_tree_greedy(
    target_logits: torch.Tensor, tree: DraftTree, rule: Rule, relaxable: torch.Tensor | None = None
) -> TreeVerification:
    """Greedy verification of a token tree: walk down from the root, taking at each node its first child
    (in node order) that the rule accepts, i.e. the target's top-1 or, on a close call, its top-2.

    ``target_logits``: ``[N+1, V]``, row 0 scoring what follows the root and row ``i`` what follows node
    ``i``. The walk ends at a node none of whose children is accepted (``next_token`` is the target's
    top-1 there: the correction) or at a leaf (``next_token`` is the bonus). With a rule that cannot relax
    only a top-1 child is ever accepted, so the path is exactly plain greedy decoding's tokens. The
    ``class`` guard applies per node (``relaxable`` as in :func:`guarded`).
    """
    n_nodes = len(tree)
    rule.check_tree()
    if target_logits.dim() != 2 or target_logits.shape[0] != n_nodes + 1:
        shape = list(target_logits.shape)
        raise ValueError(f"target_logits must be [N+1, V] = [{n_nodes + 1}, V], got {shape}")
    values, top = top2(target_logits)  # [N+1, 2], [N+1, 2]
    values = values.float()
    layout = tree.layout  # made once per tree shape: no host loop or copy to the device per step
    parents = layout.parent_index  # long[N]
    node_tokens = tree.tokens.to(dtype=top.dtype)  # [N]
    parent_top = top.index_select(0, parents)  # [N, 2]: the target's top two where each node stands
    exact = node_tokens == parent_top[:, 0]  # [N]
    # A rival's test reads each node's whole row of logits: gathered only for the rivals.
    rows = target_logits.index_select(0, parents) if rule.name in RIVALS else target_logits
    parent_values = values.index_select(0, parents)  # [N, 2]
    relaxed = relaxed_accepts(rows, parent_values, parent_top, node_tokens, rule) & ~exact
    # Nodes are not one chain, so only the class guard applies (check_tree refused "next" above).
    relaxed = guarded(relaxed, node_tokens, parent_top[:, 0], rule, relaxable)
    every_margin = margin_measure(values[:, 0], values[:, 1], rule.margin)  # [N+1]
    accepted_h, relaxed_h, top1_h, row_margins, tokens_h = to_host(
        exact | relaxed, relaxed, top[:, 0], every_margin, node_tokens
    )
    accepted, relaxed_flags, token_list = accepted_h.tolist(), relaxed_h.tolist(), tokens_h.tolist()
    top1 = [int(t) for t in top1_h.tolist()]

    children = layout.children
    path: list[int] = []
    node = 0
    while True:
        nxt = next((child for child in children[node] if accepted[child - 1]), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    chain_prefix = 0
    while chain_prefix < len(path) and path[chain_prefix] <= tree.chain_len:
        chain_prefix += 1
    # The rows the walk judged: the root's and each path node's, but not a leaf's (its row is the bonus).
    judged = [0, *path] if children[node] else [0, *path[:-1]]
    return TreeVerification(
        n_accepted=len(path),
        next_token=top1[node],
        relaxed=torch.tensor([bool(relaxed_flags[p - 1]) for p in path], dtype=torch.bool),
        margins=row_margins[judged].float(),
        top1=torch.tensor([top1[tree.parents[p - 1]] for p in path], dtype=torch.long),
        path=tuple(path),
        tokens=tuple(int(token_list[p - 1]) for p in path),
        chain_prefix=chain_prefix,
    )


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
    if rule.name is RuleName.BLOCK:
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
    if rule.name is RuleName.ENSEMBLE and rule.relaxes and draft_probs is not None:
        theta = float(rule.theta)  # type: ignore[arg-type]  # an ensemble Rule always has its weight
        # u < min(1, v(d)/q(d)) with v = theta * p + (1 - theta) * q, again without a division.
        relaxed = (u[:k] * q_d < theta * p_d + (1.0 - theta) * q_d) & ~passed
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
    return _read_back(n, token, draft, relaxed, margin_measure(z1, z2, rule.margin), tokens[:, 0])


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
    return _read_back(n, token, draft, relaxed, margin_measure(z1, z2, margin), tokens[:, 0])


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


def _check_sampling(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: float,
) -> int:
    """Check a sampling verification's temperature and shapes, and return ``K``."""
    if not (isinstance(temperature, numbers.Real) and math.isfinite(temperature) and temperature > 0):
        raise MarspecError(
            f"temperature={temperature!r} is invalid for sampling: use a finite number > 0 "
            f"(or verify_greedy for temperature 0)"
        )
    k = _check_block(target_logits, draft_tokens)
    vocab = target_logits.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (k, vocab):
        raise ValueError(f"draft_probs must be [K, V] = [{k}, {vocab}], got {list(draft_probs.shape)}")
    return k


def sample_token(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token (long[1]) drawn from unnormalised ``weights`` [V] with randomness from ``generator``."""
    return _sample(weights, torch.rand((), generator=generator, device=weights.device))


def _sample(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token drawn from unnormalised ``weights`` [V] by inverting the CDF at the uniform ``u`` (0-dim).

    Used instead of ``torch.multinomial``, which costs ~20 ms per draw on CPU at a 150k vocabulary.
    """
    cdf = weights.cumsum(0)  # [V]
    total = cdf[-1]
    # Keep x strictly below the total so the search lands on a token whose weight is positive.
    x = torch.minimum(u * total, torch.nextafter(total, total.new_zeros(())))
    return torch.searchsorted(cdf, x.view(1), right=True)  # long[1]


def _check_block(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> int:
    """Check the ``[K+1, V]`` / ``[K]`` shapes and return ``K``."""
    if draft_tokens.dim() != 1 or draft_tokens.is_floating_point():
        shape = list(draft_tokens.shape)
        raise ValueError(f"draft_tokens must be an integer tensor [K], got {draft_tokens.dtype} {shape}")
    k = draft_tokens.shape[0]
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1 or target_logits.shape[1] < 1:
        raise ValueError(f"target_logits must be [K+1, V] = [{k + 1}, V], got {list(target_logits.shape)}")
    return k


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in a 1-D bool tensor, as a 0-dim long tensor (no host sync)."""
    return mask.long().cumprod(0).sum()


def to_host(*parts: torch.Tensor) -> list[torch.Tensor]:
    """``parts`` on the host in one device-to-host copy (the step's one synchronisation), each flattened
    and as float64, which holds token ids (< 2^53), flags and float32 margins exactly."""
    host = torch.cat([p.reshape(-1).to(torch.float64) for p in parts]).cpu()
    return list(host.split([p.numel() for p in parts]))


def _read_back(
    n: torch.Tensor,
    token: torch.Tensor,
    draft: torch.Tensor,
    relaxed: torch.Tensor,
    margins: torch.Tensor,
    top1: torch.Tensor,
) -> Verification:
    """A chain verification on the host, in one device-to-host copy: the accepted count ``n`` and the
    next token (0-dim each), and the ``[K]`` draft tokens, relaxed flags, margins and target top-1."""
    n_h, token_h, draft_h, relaxed_h, margins_h, top1_h = to_host(n, token, draft, relaxed, margins, top1)
    n_accepted = int(n_h[0])
    return Verification(
        n_accepted=n_accepted,
        next_token=int(token_h[0]),
        relaxed=relaxed_h[:n_accepted].bool(),
        margins=margins_h.float(),
        top1=top1_h.long(),
        tokens=tuple(int(t) for t in draft_h[:n_accepted].tolist()),
    )
