"""Greedy verification of a token tree: :func:`verify_tree_greedy` and its :class:`TreeVerification`.

A tree is not one chain: the walk picks, node by node, a child the rule accepts, so it has its own
verifier and its own outcome (the accepted path), sharing the rules' tests (:mod:`marspec.verify.relax`)
and the one read-back (:func:`marspec.verify.chain.to_host`) with the chain verifiers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from marspec.rules import Rule
from marspec.verify.chain import Verification, to_host
from marspec.verify.margins import margin_measure, top2
from marspec.verify.relax import guarded, relaxed_accepts

if TYPE_CHECKING:
    from marspec.interfaces import DraftTree


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
    # A rival's test reads each node's whole row of logits: gathered only for a family that reads it.
    rows = target_logits.index_select(0, parents) if rule.family.needs_rows else target_logits
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
