"""The types the decode loop, the backends and the drafters share: a draft, a token tree, a forward
clock, and the protocols (a causal LM with a KV cache; one that also keeps hidden states; a drafter).

They live in one module that imports nothing else of marspec, so every part can depend on it and it on
none of them (the backend protocol, token trees and the drafter protocol name one another's types, which
in separate modules would import one another in a circle). Building trees from drafts is the drafters'
job (:mod:`marspec.drafters.tree`).

Tree layout: node 0 is the root (the pending token, already committed); nodes ``1..K`` are the draft's
greedy chain in depth order, so an all-chain accepted path needs no cache compaction; other nodes
(siblings) follow. Every node's parent comes before it, which the attention mask and the path walk rely
on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Draft:
    """Tokens proposed for the next positions.

    ``probs`` is the drafter's real distribution q over the target's vocabulary at each drafted position
    ([k, V], float32), present when the drafter sampled its tokens (temperature > 0); lossless
    speculative sampling needs it. When drafting greedily it is present only if asked for
    (``distributions``), at temperature 1. ``None``: no distribution (a lookup's copied tokens, or not
    asked for).

    ``alternatives`` are the drafter's next-best tokens at each drafted position, best first, present
    when it was asked for them (token-tree drafting) and has them; a lookup drafter has none.
    """

    tokens: torch.Tensor  # long[k], k may be 0 when the drafter has nothing to offer
    probs: torch.Tensor | None = None  # float32[k, V]
    alternatives: torch.Tensor | None = None  # long[k, A]

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class TreeLayout:
    """What a tree's shape fixes, made once per shape and device (:func:`tree_layout`) rather than in
    Python loops every step: the shape repeats from step to step. The tensors are shared between trees
    of the shape: read them, never write them."""

    children: tuple[tuple[int, ...], ...]  # of nodes 0..N, in node order
    parent_index: torch.Tensor  # long[N]: each node's parent, on the device
    position_offsets: torch.Tensor  # long[N + 1]: each node's depth (the root's is 0), on the device
    hidden: torch.Tensor  # bool[N + 1, N + 1]: True where a row may not attend to a column, on the device


@functools.lru_cache(maxsize=64)
def tree_layout(parents: tuple[int, ...], depths: tuple[int, ...], device: torch.device) -> TreeLayout:
    """The layout of a tree whose node ``i`` (1-based) has parent ``parents[i - 1]`` and depth
    ``depths[i - 1]``. A draft's length and the tree shape give a handful of distinct shapes per run, so
    the cache stays small."""
    n = len(parents) + 1
    children: list[list[int]] = [[] for _ in range(n)]
    sees = torch.zeros(n, n, dtype=torch.bool)  # row attends to column
    sees[0, 0] = True
    for node, parent in enumerate(parents, start=1):
        children[parent].append(node)
        sees[node] = sees[parent]  # a parent precedes its children: its row is complete
        sees[node, node] = True
    return TreeLayout(
        children=tuple(tuple(c) for c in children),
        parent_index=torch.tensor(parents, dtype=torch.long, device=device),
        position_offsets=torch.tensor([0, *depths], dtype=torch.long, device=device),
        hidden=(~sees).to(device),
    )


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens as a tree. ``N`` nodes besides the root; node ``i`` (1-based) is entry ``i - 1``."""

    tokens: torch.Tensor  # long[N]
    parents: tuple[int, ...]  # [N]: parent node of each node (0 = root); a list is stored as a tuple
    depths: tuple[int, ...]  # [N]: 1 for children of the root
    chain_len: int  # nodes 1..chain_len are the draft's greedy chain

    def __post_init__(self) -> None:
        object.__setattr__(self, "parents", tuple(self.parents))
        object.__setattr__(self, "depths", tuple(self.depths))

    def __len__(self) -> int:
        return len(self.parents)

    @functools.cached_property
    def layout(self) -> TreeLayout:
        """This tree's shape's layout, on the tokens' device."""
        return tree_layout(self.parents, self.depths, self.tokens.device)

    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of each node 0..N, in node order (the chain child first, then by draft preference)."""
        return self.layout.children

    def position_offsets(self) -> torch.Tensor:
        """long[N + 1]: each node's position relative to the root (its depth; the root's is 0)."""
        return self.layout.position_offsets

    def attention_mask(self, cached: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask ``[1, 1, N + 1, cached + N + 1]`` for scoring root + nodes after ``cached``
        positions: each node sees the cache, its ancestors and itself (0), nothing else (dtype's min).
        Made on the tokens' device from the cached layout: no host loop, no copy to the device."""
        n = len(self) + 1
        mask = torch.zeros(1, 1, n, cached + n, dtype=dtype, device=self.tokens.device)
        mask[0, 0, :, cached:].masked_fill_(self.layout.hidden, torch.finfo(dtype).min)
        return mask


class ForwardClock:
    """Time spent inside a model's forwards, and how many there were: read before and after a
    generation, the difference is that generation's model time (the rest is the loop's overhead).

    On the CPU a forward returns when its work is done, so its wall time is :meth:`tick`\\ ed. On an
    accelerator a forward returns once its kernels are queued, and wall time would measure their launch:
    there the backend records a pair of device events around each forward (:meth:`record`), and the
    clock reads their elapsed time only when :attr:`seconds` is read. The decode loop reads it after its
    step's one host read, when the device has passed every event of the step, so timing never adds a
    device synchronisation.
    """

    def __init__(self) -> None:
        self._seconds = 0.0
        self.calls = 0
        self.last = 0.0  # the most recent settled forward's seconds
        self._pending: list[tuple[torch.Event, torch.Event]] = []

    def tick(self, seconds: float) -> None:
        """Count a forward that took ``seconds`` of wall time (a device whose calls return when done)."""
        self._settle()
        self._seconds += seconds
        self.last = seconds
        self.calls += 1

    def record(self, start: torch.Event, end: torch.Event) -> None:
        """Count a forward between two recorded timing events; their time is read when needed."""
        self._pending.append((start, end))
        self.calls += 1

    @property
    def seconds(self) -> float:
        """Total seconds of the forwards counted so far (waits for the device only if it has not yet
        passed a counted forward's end)."""
        self._settle()
        return self._seconds

    def _settle(self) -> None:
        for start, end in self._pending:
            end.synchronize()
            self.last = start.elapsed_time(end) / 1000.0  # milliseconds
            self._seconds += self.last
        self._pending.clear()


@runtime_checkable
class CausalLM(Protocol):
    """A causal language model with a KV cache that is extended by forwards and rolled back in place.

    A backend scores new tokens on top of its own KV cache and can forget cached positions. Everything
    else (tokenizers, chat templates, weight loading) lives outside it, so a second backend (llama.cpp,
    a compiled model, another device) implements only this.
    """

    name: str
    vocab_size: int  # rows of the LM head's output (may exceed the tokenizer's vocabulary)
    context_length: int  # most positions the model attends to; 0 when unknown
    eos_token_ids: frozenset[int]  # tokens that end a generation
    device: torch.device  # where the weights, the caches and returned logits live
    clock: ForwardClock

    @property
    def cached_len(self) -> int:
        """Number of positions held in the KV cache."""
        ...

    def reset(self) -> None:
        """Drop the cache (a new sequence starts)."""
        ...

    def keep_prefix(self, ids: torch.Tensor) -> int:
        """Keep the longest cached prefix that equals the start of ``ids`` (long[n]), drop the rest, and
        return its length: a new sequence that starts like the cached one (the next turn of a chat)
        need not score that prefix again. A backend that cannot keep one resets and returns 0."""
        ...

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append ``tokens`` (long[n], n >= 1) to the cache; return float32 logits [n, V], or [1, V] for
        the last position only when ``last_only``."""
        ...

    def forward_tree(self, tree: DraftTree, root: torch.Tensor) -> torch.Tensor:
        """Score ``root`` (long[1]) and ``tree``'s nodes in one forward, each node attending to the cache
        and its ancestors only; return float32 logits [N+1, V]. :meth:`keep_path` must follow."""
        ...

    def keep_path(self, base: int, path: tuple[int, ...]) -> None:
        """After :meth:`forward_tree` with the root at ``base``: keep the root and ``path``'s nodes as
        positions ``base + 1 ...``, drop the rest of the tree."""
        ...

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` cached positions."""
        ...


@runtime_checkable
class HiddenStates(Protocol):
    """A :class:`CausalLM` that also keeps, for every cached position, the hidden states of chosen layers:
    what a drafter coupled to the target (an EAGLE-3 head) drafts from. Opt-in and separate from
    ``CausalLM`` so a backend without it stays a complete backend; a backend that has it captures nothing
    until :meth:`capture_hidden_states` is called.

    The states are kept like the KV cache, by position: :meth:`CausalLM.forward` and
    :meth:`CausalLM.forward_tree` write the rows of the positions they score (a tree's nodes in node
    order), :meth:`CausalLM.keep_path` moves the kept path's rows as it moves keys and values, and a
    rollback leaves the rows of the positions it keeps untouched. So after a verification forward the
    rows of every kept position are there, from that same forward: no second forward.

    Layer ``i`` names the residual stream entering decoder layer ``i`` (0: the token embeddings; the
    model's layer count: the last layer's output, before the final norm), the numbering EAGLE-3 heads'
    configs and vLLM use.
    """

    hidden_size: int  # width of one layer's hidden state
    num_layers: int  # decoder layers

    def capture_hidden_states(self, layers: tuple[int, ...]) -> None:
        """From the next forward on, also keep the hidden states of ``layers`` (each in ``[0,
        num_layers]``); layers asked for before stay kept (drafters sharing one target each read theirs).
        Asking for a layer not kept yet drops the cache, whose positions have no states of it."""
        ...

    def hidden_states(self, start: int, end: int, layers: tuple[int, ...]) -> torch.Tensor:
        """The kept states of ``layers`` at cached positions ``start .. end - 1``: ``[end - start,
        len(layers) * hidden_size]``, the layers side by side in the order given, in the model's dtype
        and device."""
        ...


@runtime_checkable
class Drafter(Protocol):
    """Anything that can propose draft tokens after a context."""

    name: str
    # The model whose forwards drafting runs (its clock is drafting's cost); None for a lookup drafter.
    # The loop uses its ``clock``, ``keep_prefix`` and ``rollback`` only: an EAGLE-3 head, which cannot
    # forward without the target's hidden states, has those and is no CausalLM otherwise.
    draft_model: CausalLM | None

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        temperature: float,
        generator: torch.Generator | None,
        alternatives: int = 0,
        distributions: bool = False,
    ) -> Draft:
        """Propose up to ``k`` tokens to follow ``context`` (long[L], the whole committed sequence), and,
        if it can, its ``alternatives`` next-best tokens at each position (greedy drafting only).
        ``distributions``: also return, when drafting greedily, the distribution at temperature 1 each
        token is the argmax of (the ``ensemble`` rule reads it), if the drafter has one."""
        ...

    def rollback(self, valid_len: int) -> None:
        """The first ``valid_len`` tokens of the context are final; forget any state beyond them."""
        ...

    def reset(self) -> None:
        """A new sequence starts."""
        ...


@runtime_checkable
class TreeDrafter(Protocol):
    """A drafter that grows its own token tree for tree drafting, rather than having the loop add its
    next-best tokens beside its chain (:func:`marspec.drafters.tree.build_tree`): an EAGLE-3 head
    expands the nodes it is most confident of, as EAGLE-2 does."""

    def propose_tree(
        self, context: torch.Tensor, k: int, shape: tuple[int, ...]
    ) -> tuple[Draft, DraftTree | None]:
        """A greedy draft (its chain, which the tree's nodes ``1..chain_len`` are) and a tree at most ``k``
        deep, of no more nodes than ``shape``'s tree for a chain of ``k``
        (:func:`marspec.drafters.tree.node_budget`); no tree when there is nothing to draft yet."""
        ...
