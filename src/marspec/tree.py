"""Token trees: several draft candidates per depth, verified by the target in one forward.

A tree here is the draft model's greedy chain plus, at the first few depths, the draft's next-best tokens
at that depth as extra leaves (siblings of the chain node). The siblings cost no draft forward: they come
from the logits the chain was drafted from. They pay when the target rejects the chain token at a depth
but accepts a sibling, which then also earns the bonus token after it.

Layout: node 0 is the root (the pending token, already committed); nodes ``1..K`` are the chain in depth
order, so an all-chain accepted path needs no cache compaction; siblings follow. Every node's parent comes
before it, which is what the attention mask and the path walk rely on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from marspec.drafters.base import Draft
from marspec.errors import MarspecError


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


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens as a tree. ``N`` nodes besides the root; node ``i`` (1-based) is entry ``i - 1``."""

    tokens: torch.Tensor  # long[N]
    parents: list[int]  # [N]: parent node of each node (0 = root)
    depths: list[int]  # [N]: 1 for children of the root
    chain_len: int  # nodes 1..chain_len are the draft's greedy chain

    def __len__(self) -> int:
        return len(self.parents)

    def children(self) -> list[list[int]]:
        """Children of each node 0..N, in node order (the chain child first, then by draft preference)."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for node, parent in enumerate(self.parents, start=1):
            out[parent].append(node)
        return out

    def position_offsets(self) -> torch.Tensor:
        """long[N + 1]: each node's position relative to the root (its depth; the root's is 0)."""
        return torch.tensor([0, *self.depths], dtype=torch.long, device=self.tokens.device)

    def attention_mask(self, cached: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask ``[1, 1, N + 1, cached + N + 1]`` for scoring root + nodes after ``cached``
        positions: each node sees the cache, its ancestors and itself (0), nothing else (dtype's min)."""
        n = len(self) + 1
        sees = torch.zeros(n, n, dtype=torch.bool)  # [N + 1, N + 1]: row attends to column
        sees[0, 0] = True
        for node, parent in enumerate(self.parents, start=1):
            sees[node] = sees[parent]
            sees[node, node] = True
        mask = torch.zeros(1, 1, n, cached + n, dtype=dtype)
        mask[0, 0, :, cached:].masked_fill_(~sees, torch.finfo(dtype).min)
        return mask.to(self.tokens.device)


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
    tokens = [draft.tokens]
    parents = list(range(k))
    depths = list(range(1, k + 1))
    alternatives = draft.alternatives
    if alternatives is not None:
        for depth in range(1, min(k, len(shape)) + 1):
            extra = min(shape[depth - 1] - 1, int(alternatives.shape[1]))
            if extra <= 0:
                continue
            tokens.append(alternatives[depth - 1, :extra])
            parents.extend([depth - 1] * extra)
            depths.extend([depth] * extra)
    return DraftTree(tokens=torch.cat(tokens), parents=parents, depths=depths, chain_len=k)
