"""Two parts of a decode step, as they were before the hot-path change (commit 4ff0209) and as they are
now, timed side by side in one process on the CPU:

- a token tree's step work outside the forward: its attention mask, its parents as a device tensor and
  its children lists. Before, every step rebuilt them in Python loops and copied the mask to the
  device; now the layout is made once per tree shape (marspec.interfaces.tree_layout) and the mask is
  filled from it on the device.
- committing a step's tokens to the sequence buffer. Before, the tokens the verdict had just read to
  the host were copied back to the device as a new tensor; now drafts are written into the buffer
  before the forward (the forward scores a slice of it) and only the new token is filled in.

Sizes are the default pair's: k = 12 drafts, tree 3,2 (15 nodes), 512 cached positions. Medians of
``--repeats`` rounds of ``--calls`` calls each, rounds interleaved. On a CPU the copy to the device is a
plain copy, so the second part shows only the host-side work saved; on a GPU it also saves a transfer.

    PYTHONPATH=src python benchmarks/hot_path_parts.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from marspec.drafters.tree import build_tree
from marspec.interfaces import Draft, DraftTree

K, SHAPE, CACHED = 12, (3, 2), 512


def tree_parts_before(tree: DraftTree, cached: int, dtype: torch.dtype) -> tuple:
    """The mask, parents tensor and children as commit 4ff0209 made them every step."""
    n = len(tree) + 1
    sees = torch.zeros(n, n, dtype=torch.bool)
    sees[0, 0] = True
    for node, parent in enumerate(tree.parents, start=1):
        sees[node] = sees[parent]
        sees[node, node] = True
    mask = torch.zeros(1, 1, n, cached + n, dtype=dtype)
    mask[0, 0, :, cached:].masked_fill_(~sees, torch.finfo(dtype).min)
    mask = mask.to(tree.tokens.device)
    offsets = torch.tensor([0, *tree.depths], dtype=torch.long, device=tree.tokens.device)
    parents = torch.tensor(tree.parents, dtype=torch.long, device=tree.tokens.device)
    children: list[list[int]] = [[] for _ in range(n)]
    for node, parent in enumerate(tree.parents, start=1):
        children[parent].append(node)
    return mask, offsets, parents, children


def tree_parts_after(tree: DraftTree, cached: int, dtype: torch.dtype) -> tuple:
    layout = tree.layout
    return tree.attention_mask(cached, dtype), layout.position_offsets, layout.parent_index, layout.children


def commit_before(seq: torch.Tensor, length: int, draft: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    scored = torch.cat((seq[length - 1 : length], draft))  # the forward's input
    seq[length : length + len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=seq.device)
    return scored


def commit_after(seq: torch.Tensor, length: int, draft: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    seq[length : length + draft.shape[0]] = draft
    scored = seq[length - 1 : length + draft.shape[0]]
    for i in range(len(tokens) - 1, len(tokens)):  # all drafts accepted: only the bonus is new
        seq[length + i] = tokens[i]
    return scored


def timed(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    draft = Draft(
        tokens=torch.randint(151936, (K,), generator=gen),
        alternatives=torch.randint(151936, (K, max(SHAPE) - 1), generator=gen),
    )
    # A new tree object each call, as each step builds one (its layout is looked up, not rebuilt).
    parts = {
        "tree_before": lambda: tree_parts_before(build_tree(draft, SHAPE), CACHED, torch.float32),
        "tree_after": lambda: tree_parts_after(build_tree(draft, SHAPE), CACHED, torch.float32),
    }
    seq = torch.zeros(CACHED + 64, dtype=torch.long)
    tokens = [*draft.tokens.tolist(), 7]
    parts["commit_before"] = lambda: commit_before(seq, CACHED, draft.tokens, tokens)
    parts["commit_after"] = lambda: commit_after(seq, CACHED, draft.tokens, tokens)
    # The two ways give the same results.
    before, after = parts["tree_before"](), parts["tree_after"]()
    assert all(map(torch.equal, before[:3], after[:3])) and list(map(tuple, before[3])) == list(after[3])
    seq_before, seq_after = seq.clone(), seq.clone()
    assert torch.equal(
        commit_before(seq_before, CACHED, draft.tokens, tokens),
        commit_after(seq_after, CACHED, draft.tokens, tokens),
    )
    assert torch.equal(seq_before, seq_after)
    samples: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(args.repeats):
        for name, fn in parts.items():
            samples[name].append(timed(fn, args.calls))
    report = {name: statistics.median(s) for name, s in samples.items()}
    report["load_average"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
