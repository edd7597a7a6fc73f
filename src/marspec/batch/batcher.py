"""Model forwards of sequences decoded side by side, gathered and run together.

Each sequence of a batch is decoded by the ordinary decode loop (:func:`marspec.decode.decode`) in a
thread of its own, on a :class:`SlotLM`: a view of the shared model with the sequence's own KV cache, whose
forwards are handed to the :class:`Batcher` and wait there. The batcher's thread (the dispatcher) runs
them once every sequence is waiting: all the draft model's forwards that are waiting, as one packed
forward, until no sequence drafts any more; then the target's, as one packed forward (the verifications
of every sequence and a chunk of each new prompt). So each step reads the target's weights once for the
whole batch, and the draft's once per draft position.

A sequence's thread runs its own Python (drafting decisions, verification, stop strings) while the
others wait for the same forward: the loop is unchanged, each rule, k, temperature, seed and stop is the
sequence's own, and what it decodes is what it would decode alone whenever its forwards are exact
(:func:`marspec.backends.packed.rows_alone`; other models run each sequence's forward on its own).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from marspec.backends.fixed import QUERY_SIZES, FixedShapeLM, LengthOnlyCache
from marspec.backends.fixed_batch import HIDDEN_STATES_REFUSAL, SlotRows, shared_batch
from marspec.backends.hf import HFCausalLM
from marspec.backends.packed import forward_packed, rows_alone
from marspec.errors import MarspecError
from marspec.interfaces import DraftTree


class BatchClosed(MarspecError):
    """The batch stopped (closed by its owner) while a sequence was waiting for a forward."""


@dataclass(eq=False)
class _Call:
    """A forward a sequence waits for: a chain (``tokens``) or a token tree (``tree`` after ``root``)."""

    lm: SlotLM
    tokens: torch.Tensor | None = None  # long[n]
    last_only: bool = False
    tree: DraftTree | None = None
    root: torch.Tensor | None = None  # long[1]
    done: threading.Event = field(default_factory=threading.Event)
    result: torch.Tensor | None = None
    error: BaseException | None = None

    def run_alone(self) -> torch.Tensor:
        """The forward on its own: the slot's model as a single sequence's forward."""
        if self.tree is not None:
            assert self.root is not None
            return HFCausalLM.forward_tree(self.lm, self.tree, self.root)
        assert self.tokens is not None
        return HFCausalLM.forward(self.lm, self.tokens, self.last_only)


class Batcher:
    """Gathers the forwards of member threads (one sequence each) and runs them, from the dispatcher's
    thread, once every member waits (:meth:`ready`). ``target`` is the model whose forwards run last in a
    step (the verification): any other model's waiting forwards (draft steps) run first."""

    # Whether members whose forwards have run are woken one at a time, each when the one before it waits
    # again (submits its next forward, or ends), rather than all at once. All at once they contend for
    # the GIL, which each of their torch calls hands over, and every hand-over between runnable threads
    # costs a thread switch: 64 tiny-model sequences spent ~0.9 ms of host time each per step so, against
    # ~0.15 ms for one sequence alone (docs/results.md, "Several users at once"). False for comparisons.
    wakes_in_turn = True

    def __init__(self, target: torch.nn.Module) -> None:
        self._target = target
        self._cond = threading.Condition()
        self._members = 0  # threads decoding a sequence
        self._running = 0  # members not waiting for a forward (woken, or whose turn to wake is to come)
        self._calls: list[_Call] = []
        self._turns: deque[_Call] = deque()  # calls that have run, their members not woken yet
        self._closed: BaseException | None = None
        self.peak = 0  # the most sequences one target forward has served

    # -- member threads -----------------------------------------------------------------------------------

    def join(self) -> None:
        """Count a new member, running (call from the dispatcher before starting its thread)."""
        with self._cond:
            self._members += 1
            self._running += 1

    def leave(self) -> None:
        """A member's thread ends (call from it, last)."""
        with self._cond:
            self._members -= 1
            self._running -= 1
            self._wake_next()
            self._cond.notify_all()

    def submit(self, call: _Call) -> torch.Tensor:
        """Wait (in a member's thread) until ``call`` has run; return its logits or raise its error."""
        with self._cond:
            if self._closed is not None:
                raise self._closed
            self._calls.append(call)
            self._running -= 1
            self._wake_next()
            self._cond.notify_all()
        call.done.wait()
        if call.error is not None:
            raise call.error
        assert call.result is not None
        return call.result

    # -- the dispatcher -----------------------------------------------------------------------------------

    @property
    def members(self) -> int:
        return self._members

    def ready(self) -> bool:
        """Whether every member waits for a forward (and there is one to run)."""
        return self._running == 0 and bool(self._calls)

    def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` (checked under the batcher's lock, woken by every change of its
        members or calls, and by :meth:`poke`) or ``timeout`` seconds pass; returns the predicate."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def poke(self) -> None:
        """Wake :meth:`wait_until` to check its predicate again (something else it reads changed)."""
        with self._cond:
            self._cond.notify_all()

    def run_once(self) -> int:
        """Run one model's waiting forwards (when :meth:`ready`): a draft model's before the target's,
        packed into one forward where the model computes rows alone. Returns how many ran."""
        with self._cond:
            if not self.ready():
                return 0
            group = self._pick()
            self._calls = [call for call in self._calls if call not in group]
            self._running += len(group)
        if isinstance(group[0].lm, FixedSlotLM):  # every sequence of a model on the fixed path: one forward
            self._run_fixed(group)
        else:
            self._run_eager(group)
        if group[0].lm.model is self._target:
            self.peak = max(self.peak, len(group))
        with self._cond:
            self._turns.extend(group)
            if self.wakes_in_turn and self._closed is None:
                self._wake_next()
            else:
                self._wake_all()
        return len(group)

    def _wake_next(self) -> None:
        """Wake the next member whose forward has run (under the lock)."""
        if self._turns:
            self._turns.popleft().done.set()

    def _wake_all(self) -> None:
        while self._turns:
            self._turns.popleft().done.set()

    def close(self, error: BaseException) -> None:
        """Fail every waiting forward and every later one with ``error`` (the batch stops)."""
        with self._cond:
            self._closed = error
            waiting, self._calls = self._calls, []
            self._running += len(waiting)
            self._wake_all()
            self._cond.notify_all()
        for call in waiting:
            call.error = error
            call.done.set()

    def _pick(self) -> list[_Call]:
        """The calls of the model to run next: a drafting model's while any waits, else the target's."""
        models = [call.lm.model for call in self._calls]
        model = next((m for m in models if m is not self._target), models[0])
        return [call for call in self._calls if call.lm.model is model]

    def _run_eager(self, group: list[_Call]) -> None:
        """The calls packed into one forward where their model computes rows alone, else one by one."""
        packable = [c for c in group if c.tree is None and rows_alone(c.lm)] if len(group) > 1 else []
        if len(packable) > 1:
            self._run_packed(packable)
        for call in group:
            if call not in packable:
                self._run_alone(call)

    @staticmethod
    def _run_packed(calls: list[_Call]) -> None:
        def together(group: list[_Call]) -> list[torch.Tensor]:
            if len(group) == 1:
                return [group[0].run_alone()]
            return forward_packed([(c.lm, c.tokens, c.last_only) for c in group])  # type: ignore[misc]

        _deliver(calls, together)

    @staticmethod
    def _run_fixed(calls: list[_Call]) -> None:
        _deliver(calls, lambda group: group[0].lm.batch_forward(group))  # type: ignore[attr-defined]

    @staticmethod
    def _run_alone(call: _Call) -> None:
        _deliver([call], lambda group: [group[0].run_alone()])


def _deliver(calls: list[_Call], run: Callable[[list[_Call]], list[torch.Tensor]]) -> None:
    """Run ``calls`` as one forward (``run``) and give each its logits, or its error.

    One sequence's input must not fail the others: when a forward of several calls raises, each is run
    again on its own, so the error reaches only the sequences whose own forward raises it and the rest get
    the logits they would have got (a failed forward leaves every cache as it was: the packed one crops
    what it wrote, the fixed-shape one advances a slot's length only after success)."""
    try:
        results = run(calls)
    except Exception as exc:
        if len(calls) == 1:
            calls[0].error = exc
            return
        for call in calls:
            _deliver([call], run)
        return
    except BaseException as exc:  # an interrupt: every sequence of the forward sees it
        for call in calls:
            call.error = exc
        return
    for call, logits in zip(calls, results, strict=True):
        call.result = logits


class SlotLM(HFCausalLM):
    """One sequence's view of a shared model: its own KV cache, its forwards run by a :class:`Batcher`.

    Everything but the forwards (rollback, prefix reuse, hidden states) is the transformers backend's
    own. A prompt longer than ``prefill_chunk`` tokens is scored in chunks of that size, one per step, so
    a new sequence's prefill shares the forwards of the running ones instead of stalling them; chunks are
    taken only where rows are computed alone, so chunking changes nothing the sequence decodes.
    """

    def __init__(self, base: HFCausalLM, batcher: Batcher, prefill_chunk: int) -> None:
        super().__init__(base.model, base.tokenizer, base.name, base.position_cache)
        self._batcher = batcher
        self._prefill_chunk = prefill_chunk

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        n, chunk = int(tokens.shape[0]), self._prefill_chunk
        if n <= chunk or not self._chunks_exactly():
            return self._batcher.submit(_Call(self, tokens, last_only))
        pieces = [tokens[start : start + chunk] for start in range(0, n, chunk)]
        parts = [self._batcher.submit(_Call(self, piece, last_only)) for piece in pieces]
        return parts[-1] if last_only else torch.cat(parts)

    def forward_tree(self, tree: DraftTree, root: torch.Tensor) -> torch.Tensor:
        return self._batcher.submit(_Call(self, tree=tree, root=root))

    def _chunks_exactly(self) -> bool:
        """Whether a prompt scored in chunks is cached and scored as in one forward."""
        return rows_alone(self)


class FixedSlotLM(LengthOnlyCache, SlotLM):
    """One sequence's view of a model on the fixed-shape path with a batch dimension: a slot of the
    shared :class:`~marspec.backends.fixed_batch.FixedBatch` (its rows of every layer's buffers), its
    forwards run by a :class:`Batcher` together with the other slots' as one [B, m] forward. The host keeps
    the slot's cache length and token ids, so a rollback or a kept prefix copies nothing. A prompt is
    scored in chunks of at most the largest captured query size, one per step, so every forward is a
    captured shape and a new prompt shares the running sequences' steps.
    """

    def __init__(self, base: FixedShapeLM, batcher: Batcher) -> None:
        super().__init__(base, batcher, QUERY_SIZES[-1])
        self._shared = shared_batch(base)
        self.slot = self._shared.claim()

    def release(self) -> None:
        """Give the slot back to the shared batch (the view is not used again)."""
        self._shared.release(self.slot)

    @property
    def direct(self) -> None:
        return None  # the shared batched forward runs transformers' model

    def capture_hidden_states(self, layers: tuple[int, ...]) -> None:
        raise MarspecError(HIDDEN_STATES_REFUSAL)

    def keep_path(self, base: int, path: tuple[int, ...]) -> None:
        for i, node in enumerate(path, start=1):
            if node != i:
                self._shared.move(self.slot, base + node, base + i)
                self._ids[base + i] = self._ids[base + node]
        self.rollback(base + 1 + len(path))

    def _chunks_exactly(self) -> bool:
        return True  # every slot's rows meet only its own: chunks of captured sizes, the same cache

    def batch_forward(self, calls: list[_Call]) -> list[torch.Tensor]:
        """Run ``calls`` (forwards of slots of this view's batch, one each) as one batched forward;
        each slot's length and ids advance as its own forward's would."""
        lms: list[FixedSlotLM] = [call.lm for call in calls]  # type: ignore[misc]
        rows = []
        for lm, call in zip(lms, calls, strict=True):
            tokens = call.tokens if call.tree is None else torch.cat((call.root, call.tree.tokens))  # type: ignore[arg-type]
            rows.append(SlotRows(lm.slot, lm.cached_len, tokens, call.tree, call.last_only))
        start = self._timer.start()
        results = self._shared.run(rows)
        self._timer.stop(start, also=[lm.clock for lm in lms if lm is not self])  # all waited for all of it
        for lm, row in zip(lms, rows, strict=True):
            lm.note_appended(row.tokens)
        return results
