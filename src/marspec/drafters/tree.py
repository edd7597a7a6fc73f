"""Token trees from drafts: several candidates per depth, verified by the target in one forward.

A tree here is the draft model's greedy chain plus, at the first few depths, the draft's next-best tokens
at that depth as extra leaves (siblings of the chain node). The siblings cost no draft forward: they come
from the logits the chain was drafted from. They pay when the target rejects the chain token at a depth
but accepts a sibling, which then also earns the bonus token after it. The tree type and its layout are
:class:`marspec.interfaces.DraftTree` (shared with the backends and verification).
"""

from __future__ import annotations

import functools

import torch

from marspec.errors import MarspecError
from marspec.interfaces import Draft, DraftTree


def parse_tree_shape(spec: str | tuple[int, ...] | list[int] | None) -> tuple[int, ...] | None:
    """``"3,2"`` -> ``(3, 2)``: candidates per depth (depth 1 first; depths past the end get 1, the chain).

    ``None``, ``""`` and all-ones shapes mean no tree (plain chain drafting).
    """
    if spec is None or spec == "":
        return None
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    widths: list[int] = []
    for item in items:
        try:
            width = int(item)
        except (TypeError, ValueError):
            raise MarspecError(
                f"tree shape: {item!r} is not a whole number (use e.g. 3,2: 3 candidates at depth 1, "
                f"2 at depth 2, the chain alone deeper)"
            ) from None
        if width < 1:
            raise MarspecError(f"tree shape: each depth needs at least 1 candidate, got {item!r}")
        widths.append(width)
    while widths and widths[-1] == 1:
        widths.pop()
    return tuple(widths) or None


def chain_tree(tokens: torch.Tensor) -> DraftTree:
    """A tree that is just the chain ``tokens`` (long[K]): verifying it is verifying the chain."""
    k = int(tokens.shape[0])
    return DraftTree(tokens=tokens, parents=list(range(k)), depths=list(range(1, k + 1)), chain_len=k)


def build_tree(draft: Draft, shape: tuple[int, ...]) -> DraftTree:
    """The draft's chain, plus at depth ``d`` its ``shape[d - 1] - 1`` next-best tokens as leaves.

    ``draft.alternatives`` (long[K, A]) holds the draft's next-best tokens at each chain position, best
    first; a depth gets at most ``A`` siblings.
    """
    k = len(draft)
    alternatives = draft.alternatives
    width = 0 if alternatives is None else int(alternatives.shape[1])
    parents, depths, extras = _tree_structure(k, shape, width)
    tokens = draft.tokens
    if extras:  # the siblings, taken from the alternatives (extras is empty without them)
        assert alternatives is not None
        tokens = torch.cat([tokens, *(alternatives[depth - 1, :extra] for depth, extra in extras)])
    return DraftTree(tokens=tokens, parents=parents, depths=depths, chain_len=k)


@functools.lru_cache(maxsize=64)
def _tree_structure(
    k: int, shape: tuple[int, ...], width: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, int], ...]]:
    """Parents and depths of :func:`build_tree`'s tree for a chain of ``k`` with ``width`` alternatives
    per position, and the ``(depth, siblings)`` it adds: the same few shapes recur every step."""
    parents = list(range(k))
    depths = list(range(1, k + 1))
    extras = []
    for depth in range(1, min(k, len(shape)) + 1):
        extra = min(shape[depth - 1] - 1, width)
        if extra > 0:
            extras.append((depth, extra))
            parents.extend([depth - 1] * extra)
            depths.extend([depth] * extra)
    return tuple(parents), tuple(depths), tuple(extras)


def node_budget(k: int, shape: tuple[int, ...]) -> int:
    """How many nodes :func:`build_tree` gives a chain of ``k`` under ``shape`` when every sibling is at
    hand: what a drafter that grows its own tree (:class:`marspec.interfaces.TreeDrafter`) spends, so
    that both kinds of tree cost the target the same verification forward."""
    return k + sum(width - 1 for width in shape[:k])


def best_first_tree(
    tokens: list[int],
    parents: list[int],
    depths: list[int],
    scores: list[float],
    budget: int,
    device: torch.device,
) -> DraftTree:
    """The ``budget`` best-scored candidates as a tree (EAGLE-2's reranking).

    Candidate ``i`` has token ``tokens[i]``, parent candidate ``parents[i]`` (-1: the root; a parent
    comes before its children), depth ``depths[i]`` and score ``scores[i]``: its cumulative
    log-probability under the drafter, never above its parent's, so the kept set holds every kept
    candidate's ancestors (a tie goes to the shallower one). The chain is the best-scored path from the
    root; nodes are numbered chain first, then by depth and score, so each node's children come in
    order of preference, as the verifier's walk wants them.
    """
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))
    kept = set(order[:budget])
    children: dict[int, list[int]] = {}
    for i in order[:budget]:  # each list best first
        children.setdefault(parents[i], []).append(i)
    chain: list[int] = []
    node = -1
    while children.get(node):
        node = children[node][0]
        chain.append(node)
    on_chain = set(chain)
    rest = sorted(kept - on_chain, key=lambda i: (depths[i], -scores[i], i))
    numbered = chain + rest
    number = {c: n for n, c in enumerate(numbered, start=1)}
    number[-1] = 0
    return DraftTree(
        tokens=torch.tensor([tokens[c] for c in numbered], dtype=torch.long, device=device),
        parents=[number[parents[c]] for c in numbered],
        depths=[depths[c] for c in numbered],
        chain_len=len(chain),
    )
