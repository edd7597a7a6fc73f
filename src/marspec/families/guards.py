"""The guards: what narrows a rule's relaxed accepts (:class:`Guard`), and the test, :func:`guarded`.

A guard is no rule of its own: each family names the guards that may narrow it (``Family.guards``; a
lossless rule takes any, since it never relaxes), and every verifier passes its relaxed accepts through
:func:`guarded`. ``next`` (MARS only) and ``class`` are ours, not the paper's: ``class`` relaxes only
where both the draft token and the target's top-1 it replaces are of the token classes
:data:`marspec.defaults.GUARD_CLASSES` (:mod:`marspec.token_classes`), read from a per-vocabulary table
the caller passes as ``relaxable``; ``thinking`` relaxes only inside a reasoning model's thinking span.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from marspec.errors import MarspecError
from marspec.families.base import Setting, SettingName

if TYPE_CHECKING:
    import torch

    from marspec.thinking import ThinkingSpan


class Guard(SettingName):
    """What narrows a rule's relaxed accepts."""

    NONE = "none"
    # "next" (our variant, not the paper's): a close call is relaxed only where the draft's next token is
    # the target's top choice after the relaxed token, read from the same verification forward. The last
    # draft position has no next draft token, so it is never relaxed under this guard.
    NEXT = "next"
    # "class" (ours): a relaxed accept only where the draft token and the top-1 it replaces are both of
    # the token classes measured harmless (marspec.defaults.GUARD_CLASSES, docs/rules.md).
    CLASS = "class"
    # "thinking": relax only between a thinking-start and a thinking-end token (a reasoning model's
    # scratch work), never on the markers themselves; the answer after the span is verified strictly.
    THINKING = "thinking"


GUARDS: tuple[Guard, ...] = tuple(Guard)
# Why a guard cannot narrow a token tree's accepts (it reads along one chain), for those that cannot.
TREE_REFUSALS: dict[Guard, str] = {
    Guard.NEXT: "the 'next' guard works on draft chains, not token trees: drop the guard or the tree",
    Guard.THINKING: (
        "the 'thinking' guard follows its span along a draft chain, not a token tree: drop the guard or "
        "the tree"
    ),
}


def guarded(
    relaxed: torch.Tensor,
    draft: torch.Tensor,
    top1: torch.Tensor,
    rule: Setting,
    relaxable: torch.Tensor | None = None,
    span: ThinkingSpan | None = None,
) -> torch.Tensor:
    """``relaxed`` (bool ``[K]``) narrowed by ``rule``'s guard. ``draft`` and ``top1`` (``long[K]``,
    the target's top-1 at each draft position) are one chain, so ``top1[1:]`` is the target's choice
    after each draft token, which the ``next`` guard reads. The ``class`` guard reads ``relaxable``
    (bool ``[V]``, :func:`marspec.token_classes.relaxable_table`) at the draft token and at the top-1;
    the ``thinking`` guard reads ``span`` (:meth:`marspec.thinking.ThinkingMarkers.span`)."""
    if rule.guard == Guard.NEXT:
        return relaxed & _next_allows(draft, top1[1:])
    if rule.guard == Guard.CLASS:
        return relaxed & _class_allows(draft, top1, relaxable)
    if rule.guard == Guard.THINKING:
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


def _next_allows(draft: torch.Tensor, next_top1: torch.Tensor) -> torch.Tensor:
    """Bool ``[K]``: where the ``next`` guard lets a close call relax. ``next_top1`` (``long[K-1]``) is
    the target's top-1 at draft positions 1..K-1, each scored after the draft token before it."""
    import torch

    k = draft.shape[0]
    allowed = torch.zeros(k, dtype=torch.bool, device=draft.device)
    allowed[: k - 1] = draft[1:] == next_top1.to(draft.dtype)
    return allowed
