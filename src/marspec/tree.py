"""Token trees, by their public path: the tree type lives with the types the loop, the backends and the
drafters share (:mod:`marspec.interfaces`), building trees from drafts with the drafters
(:mod:`marspec.drafters.tree`)."""

from marspec.drafters.tree import build_tree, chain_tree, parse_tree_shape
from marspec.interfaces import DraftTree, TreeLayout, tree_layout

__all__ = ["DraftTree", "TreeLayout", "build_tree", "chain_tree", "parse_tree_shape", "tree_layout"]
