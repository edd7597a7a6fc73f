"""Drafting with an EAGLE-3 head: one decoder layer on the target's own hidden states.

The target keeps the hidden states of the head's feature layers at its cached positions
(:class:`marspec.interfaces.HiddenStates`): its verification forward writes them, no second forward.
Before each draft the head catches up on the positions the target has scored since (those carry the
target's states, and the accepted tokens after them), then drafts one token per head step, feeding its
own output forward as the next position's feature. Its cache holds the caught-up positions plus the draft
steps; the draft steps are dropped at the next proposal (the target has scored those positions by then,
and the head recomputes them from the target's states, as EAGLE does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from marspec.backends.timing import ForwardTimer
from marspec.drafters.eagle3_fixed import FixedHeadCache
from marspec.drafters.eagle3_head import Eagle3Head, HeadCache, TreeRows
from marspec.drafters.tree import best_first_tree, node_budget
from marspec.errors import MarspecError
from marspec.interfaces import CausalLM, Draft, DraftTree, ForwardClock, HiddenStates
from marspec.verify.chain import sample_token
from marspec.verify.top_tokens import argmax


class HeadModel:
    """The head with its cache for one sequence and the clock of its forwards: the drafter's
    ``draft_model`` (the loop reads its clock and asks it which prefix of a new prompt it still holds).

    ``cached_len`` counts the positions caught up from the target's states; position ``p`` read the
    context's tokens up to ``p + 1``.
    """

    def __init__(
        self,
        head: Eagle3Head,
        name: str,
        device: torch.device,
        cache: HeadCache | FixedHeadCache | None = None,
    ) -> None:
        self.head = head
        self.name = name
        self.device = device
        self.cache = cache if cache is not None else HeadCache(head)
        self.clock = ForwardClock()
        self._timer = ForwardTimer(device, self.clock)
        self.cached_len = 0
        self._ids = torch.empty(
            0, dtype=torch.long, device=device
        )  # the context the caught-up positions read

    def keep_prefix(self, ids: torch.Tensor) -> int:
        """How many leading tokens of ``ids`` (long[n]) the caught-up positions read as they are in
        ``ids``: the drafter's ``rollback`` of that keeps the positions they still hold."""
        n = min(int(self._ids.shape[0]), int(ids.shape[0]))
        if n == 0:
            return 0
        differs = self._ids[:n] != ids[:n].to(self._ids.device)
        return int(torch.cumsum(differs, 0).eq(0).sum())

    def keep(self, positions: int) -> None:
        """Keep the first ``positions`` caught-up positions; forget the rest and any draft steps."""
        self.cached_len = min(self.cached_len, positions)
        self.cache.rollback(self.cached_len)
        self._ids = self._ids[: self.cached_len + 1 if self.cached_len else 0]

    def reset(self) -> None:
        self.cached_len = 0
        self.cache.reset()
        self._ids = self._ids[:0]

    def run(
        self, tokens: torch.Tensor, features: torch.Tensor, tree: TreeRows | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One timed head forward over more rows (see :meth:`HeadCache.step`)."""
        start = self._timer.start()
        logits, streams = self.cache.step(tokens, features, tree)
        self._timer.stop(start)
        return logits, streams

    def catch_up(self, context: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the positions ``cached_len ...`` whose target states are ``states`` ([n, layers x H]),
        each reading the context's next token; returns the last position's logits and stream."""
        start = self.cached_len
        end = start + int(states.shape[0])
        with torch.inference_mode():
            features = self.head.fc(states)
        logits, streams = self.run(context[start + 1 : end + 1], features)
        self.cached_len = end
        self._ids = context[: end + 1].clone()  # the caller's buffer may be written past its length
        return logits[-1], streams[-1:]


class Eagle3Drafter:
    """Drafts with an EAGLE-3 head coupled to ``target`` (which must keep hidden states).

    ``min_confidence`` ends a draft after a token whose probability under the head (at temperature 1,
    over the draft vocabulary) is below it, as :class:`marspec.drafters.ModelDrafter` does. ``cache``
    holds the head's keys and values (default a :class:`HeadCache`; the fixed-shape path passes a
    :class:`FixedHeadCache`).
    """

    def __init__(
        self,
        head: Eagle3Head,
        target: CausalLM,
        layers: tuple[int, ...],
        name: str,
        min_confidence: float = 0.0,
        cache: HeadCache | FixedHeadCache | None = None,
    ) -> None:
        if not isinstance(target, HiddenStates):
            raise MarspecError(
                f"an EAGLE-3 head drafts from the target's hidden states, and the backend of {target.name!r} "
                "does not keep them (it lacks capture_hidden_states): use the transformers backend"
            )
        if not 0.0 <= min_confidence <= 1.0:
            raise MarspecError(f"draft min_confidence must be in [0, 1], got {min_confidence!r}")
        target.capture_hidden_states(layers)
        self.target = target
        self.layers = layers
        self.name = name
        self.min_confidence = min_confidence
        self.draft_model = HeadModel(head, name, target.device, cache)
        self._target_ids = head.target_ids()  # long[draft vocab]

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        temperature: float,
        generator: torch.Generator | None,
        alternatives: int = 0,
        distributions: bool = False,
    ) -> Draft:
        model, target = self.draft_model, self.target
        caught_up = self._catch_up(context)
        if caught_up is None:
            return Draft(tokens=context.new_empty(0))
        logits, stream = caught_up
        device = logits.device
        tokens = torch.empty(k, dtype=torch.long, device=device)
        sampling = temperature > 0
        probs = torch.zeros(k, target.vocab_size, device=device) if sampling or distributions else None
        ranked = None
        if alternatives and probs is None:
            ranked = torch.empty(k, 1 + alternatives, dtype=torch.long, device=device)
        n = 0
        while n < k:
            if ranked is not None:
                top = torch.topk(logits, min(1 + alternatives, logits.shape[0])).indices
                ranked[n, : top.shape[0]] = self._target_ids[top]
                ranked[n, top.shape[0] :] = ranked[n, 0]
                tokens[n] = ranked[n, 0]
            elif probs is None:
                tokens[n] = self._target_ids[argmax(logits)]
            else:
                q = torch.softmax(logits / (temperature if sampling else 1.0), dim=-1)  # draft vocabulary
                probs[n].index_copy_(0, self._target_ids, q)  # d2t is one-to-one (checked at load)
                if sampling:
                    tokens[n] = sample_token(probs[n], generator)[0]
                else:
                    tokens[n] = self._target_ids[argmax(logits)]
            n += 1
            if n == k or self._unsure(logits):
                break
            logits, stream = model.run(tokens[n - 1 : n], stream)
            logits = logits[-1]
        return Draft(
            tokens=tokens[:n],
            probs=None if probs is None else probs[:n],
            alternatives=None if ranked is None else ranked[:n, 1:],
        )

    def propose_tree(
        self, context: torch.Tensor, k: int, shape: tuple[int, ...]
    ) -> tuple[Draft, DraftTree | None]:
        """EAGLE-2's dynamic tree (greedy drafting): depth by depth, the ``max(shape)`` best nodes so far
        (by the head's cumulative log-probability) are run in one head forward and each offers its
        ``max(shape)`` best tokens as children; the best-scored candidates, as many as ``shape``'s static
        tree has nodes for a chain of ``k`` (:func:`marspec.drafters.tree.node_budget`), make the tree.
        So the target's verification forward costs what the static tree's does, and the nodes go where
        the head expects acceptance. ``min_confidence`` does not apply: the budget bounds the tree.

        Each depth reads its candidates' scores and tokens to the host (the choice of the next frontier is
        made there), as the confidence stop reads once per drafted token.
        """
        caught_up = self._catch_up(context)
        if caught_up is None:
            return Draft(tokens=context.new_empty(0)), None
        logits, stream = caught_up
        model, width = self.draft_model, max(shape)
        base = model.cache.length  # the caught-up positions; depth-d nodes run at position base + d - 1
        tokens: list[int] = []  # target ids
        parents: list[int] = []  # candidate index, -1 for the root
        depths: list[int] = []
        scores: list[float] = []
        slots: list[int] = []  # each run candidate's row in the head's cache (-1: not run)
        streams: dict[int, torch.Tensor] = {-1: stream[0]}

        def offer(rows: torch.Tensor, expanded: list[int], depth: int) -> list[int]:
            """Each expanded candidate's ``width`` best tokens (``rows``: its draft logits), as children."""
            logp = torch.log_softmax(rows.float(), dim=-1)
            values, ids = logp.topk(min(width, logp.shape[-1]), dim=-1)
            values_h, ids_h = values.tolist(), self._target_ids[ids].tolist()
            new = []
            for parent, row_values, row_ids in zip(expanded, values_h, ids_h, strict=True):
                base_score = scores[parent] if parent >= 0 else 0.0
                for value, token in zip(row_values, row_ids, strict=True):
                    new.append(len(tokens))
                    tokens.append(token)
                    parents.append(parent)
                    depths.append(depth)
                    scores.append(base_score + value)
                    slots.append(-1)
            return new

        level = offer(logits[None], [-1], 1)
        for depth in range(1, k):
            frontier = sorted(level, key=lambda i: -scores[i])[:width]
            start = model.cache.length
            sees = torch.zeros(len(frontier), start + len(frontier), dtype=torch.bool, device=logits.device)
            sees[:, :base] = True
            for row, c in enumerate(frontier):
                slots[c] = start + row
                node = c
                while node >= 0:  # itself and its ancestors, each run at an earlier depth
                    sees[row, slots[node]] = True
                    node = parents[node]
            ids = torch.tensor([tokens[c] for c in frontier], dtype=torch.long, device=logits.device)
            features = torch.stack([streams[parents[c]] for c in frontier])
            rows, out = model.run(ids, features, TreeRows(position=base + depth - 1, sees=sees))
            for row, c in enumerate(frontier):
                streams[c] = out[row]
            level = offer(rows, frontier, depth + 1)
        tree = best_first_tree(tokens, parents, depths, scores, node_budget(k, shape), logits.device)
        return Draft(tokens=tree.tokens[: tree.chain_len]), tree

    def _catch_up(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Bring the head's cache up to the target's scored positions: the last position's draft logits
        and stream, or None when the target has scored nothing yet."""
        model, target = self.draft_model, self.target
        known = target.cached_len  # positions the target holds states of: all of the context but its last
        if known < 1:
            return None
        # Draft steps of the last proposal go; a position whose target state is gone goes too. One
        # position is always run again, so its logits are at hand even when nothing new was scored.
        model.keep(min(model.cached_len, known - 1))
        return model.catch_up(context, target.hidden_states(model.cached_len, known, self.layers))

    def _unsure(self, logits: torch.Tensor) -> bool:
        """Whether the head's top probability is below ``min_confidence`` (a host read only while the
        stop is on; see :meth:`marspec.drafters.ModelDrafter._unsure` for why it has to be one)."""
        if self.min_confidence <= 0.0:
            return False
        return float(torch.softmax(logits, dim=-1).max()) < self.min_confidence

    def for_slot(self, target: CausalLM, view: Callable[[CausalLM], CausalLM]) -> Eagle3Drafter:
        """Its twin for one sequence of a batch (:mod:`marspec.batch.slots`): a head cache of its own,
        reading the hidden states of that sequence's view of the target, ``target``."""
        return Eagle3Drafter(self.draft_model.head, target, self.layers, self.name, self.min_confidence)

    def rollback(self, valid_len: int) -> None:
        """The first ``valid_len`` context tokens are final: keep the positions that read only those."""
        self.draft_model.keep(max(0, valid_len - 1))

    def reset(self) -> None:
        self.draft_model.reset()
