"""Sequences decoded side by side on one thread: each sequence is data the scheduler advances.

A :class:`Scheduler` holds up to ``max_batch`` slots. A work (one sequence's whole generation: a
generator that asks for its model forwards, :mod:`marspec.forward_requests`) waits in a queue until a
slot is free. Each :meth:`Scheduler.step` admits what fits, then runs one model's forwards for every live
sequence waiting on that model as one forward (:mod:`marspec.batch.gather`): a draft model's while any
sequence drafts, else the target's (every verification, and a chunk of each new prompt). Each sequence is
then advanced, in the same thread, to its next forward: its drafting decisions, verification, stop
strings and text are its own. So each step reads the target's weights once for the whole batch, and the
draft's once per draft position. A work that ends (its sequence finished, was cancelled or failed) frees
its slot for the next one at once: continuous batching, as servers call it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from marspec.backends.hf import HFCausalLM
from marspec.batch.gather import Outcome, run_group
from marspec.batch.slots import Slot, batched_form, check_batchable, make_slot
from marspec.batch.views import SlotLM
from marspec.defaults import MAX_K
from marspec.draft_length.cost_model import drafting_pays
from marspec.errors import MarspecError
from marspec.forward_requests import Forward, Request
from marspec.interfaces import CausalLM, Drafter

if TYPE_CHECKING:
    from marspec.draft_length import DraftChoice

log = logging.getLogger("marspec.batch")

# One sequence's whole generation on a slot: a generator that asks for its forwards (send back the
# logits; a failed forward is thrown into it) and reports its text and end itself.
Work = Callable[[Slot], Generator[Request, torch.Tensor, None]]


class BatchClosed(MarspecError):
    """The batch stopped (closed by its owner) before a sequence finished."""


# The most prompt tokens a new sequence scores in one step. A chunk rides in the target forward of the
# running sequences' verifications, so it bounds how much longer that step gets while a prompt comes in.
PREFILL_CHUNK = 128

# The verification rows a batch's target forward aims at when its sequences' answers do not depend on
# their drafts (greedy, lossless). On 2 cores the q4k engine's products are bound by reading the weights
# up to ~4 rows and by the rows' arithmetic past ~8, so rows beyond a few cost nearly what they bring:
# served (4 prompts x 128 tokens a client), 2 clients drafting 5 or 3 tokens each decoded 55-68 tok/s
# against 49-55 drafting 7, and 4 clients drafting 2 or 3 tokens 83-93 against 74-86 decoding plain
# (docs/results.md, "Several users at once").
BATCH_VERIFY_ROWS = 12


def batched_draft_len(sequences: int, choice: DraftChoice | None = None) -> int:
    """The most tokens each of ``sequences`` decoded together drafts where its answer does not depend on
    its drafts: the batch's verification rows near :data:`BATCH_VERIFY_ROWS`, and none below two (a
    one-token draft costs a draft step for at most one token), nor where the costs this machine measured
    for the pair (``choice``, :mod:`marspec.draft_length`) expect the sequences to decode faster without
    drafts (:func:`~marspec.draft_length.cost_model.drafting_pays`: on a 2-core Zen 4, four sequences
    decoded 78.7 tok/s without drafts against 54.7-59.4 drafting 2 tokens each). One sequence alone keeps
    its own k."""
    if sequences <= 1:
        return MAX_K
    per_sequence = BATCH_VERIFY_ROWS // sequences - 1
    if per_sequence < 2:
        return 0
    if choice is not None and not drafting_pays(sequences, per_sequence, choice.acceptance, choice.costs):
        return 0
    return per_sequence


def default_max_batch(target: CausalLM) -> int:
    """How many sequences to decode together when the caller does not say. Where forwards are shared
    exactly (:func:`shares_forwards`: the CPU int8 and int4 engines) two per CPU core, 4 to 8: a
    step costs about a read of the weights until the rows' products take over (docs/results.md, "Several
    users at once"). Elsewhere 1: sequences would take turns at each forward, gaining nothing, or (the
    fixed-shape path) share forwards that may round by the batch, which a caller chooses knowingly
    (:func:`batching_note`)."""
    if not shares_forwards(target):
        return 1
    return max(4, min(8, 2 * (os.cpu_count() or 2)))


def shares_forwards(target: CausalLM) -> bool:
    """Whether sequences decoded together share the target's forwards with each row computed alone, so
    each decodes what it decodes alone, bit for bit (:mod:`marspec.backends.packed`). Elsewhere each
    sequence runs its own forward in turn (exact, without a gain), or, on the fixed-shape path, the
    sequences share batched forwards that may round by the batch (:func:`batching_note`)."""
    return isinstance(target, HFCausalLM) and batched_form(target) == "packed"


def batching_note(target: CausalLM, max_batch: int, option: str = "max_batch") -> str | None:
    """The one line a caller decoding ``max_batch`` > 1 sequences together on ``target`` should read, or
    None where batching is exact and shares forwards; ``option`` names the setting as the caller knows it
    (``--max-batch`` for the server)."""
    if max_batch <= 1 or shares_forwards(target):
        return None
    if isinstance(target, HFCausalLM) and batched_form(target) == "fixed":
        return (
            f"{option} {max_batch}: the fixed-shape path decodes sequences together in batched forwards "
            "whose products may round by the batch, so an answer can differ from its solo one where the "
            f"target's top two nearly tie; with {option} 1 every answer is its solo one"
        )
    return (
        f"{option} {max_batch}: this target computes rows together, so sequences decoded together take "
        "turns at each forward: exact, but no faster than one at a time (the CPU int8 and int4 engines, "
        "and the fixed-shape path on a GPU, share them)"
    )


def settle_max_batch(target: CausalLM, max_batch: object) -> int:
    """The sequences to decode together on ``target``: ``max_batch`` checked, or where it is None the
    target's default (:func:`default_max_batch`). The one place either is decided."""
    return default_max_batch(target) if max_batch is None else check_max_batch(max_batch)


def check_max_batch(max_batch: object) -> int:
    """``max_batch`` checked: an integer >= 1 (a one-line error otherwise)."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise MarspecError(
            f"max_batch (sequences decoded together) must be an integer >= 1, got {max_batch!r}"
        )
    return max_batch


@dataclass(eq=False)
class _Live:
    """A sequence being decoded: its slot, its generation, and the forward it waits for."""

    slot: Slot
    run: Generator[Request, torch.Tensor, None]
    request: Request | None = None
    chunks: int = 1  # forwards of the batch the request is scored in (a long prompt: chunks of it)
    parts: list[torch.Tensor] = field(default_factory=list)  # the logits of its chunks scored so far


class Scheduler:
    """Decodes works side by side on up to ``max_batch`` slots of the pair ``target`` + ``drafter``
    (None: the target's default, :func:`settle_max_batch`). Its queue is the one queue of works waiting
    for a slot (a server's admission, withdrawal of a cancelled or timed-out request, shutdown).

    Thread use: :meth:`add`, :meth:`poke` and :meth:`wait_for_work` from any thread; :meth:`step` and
    :meth:`close` from one, which runs every model forward and every sequence's decode loop.
    """

    def __init__(
        self,
        target: HFCausalLM,
        drafter: Drafter | None,
        max_batch: int | None,
        prefill_chunk: int = PREFILL_CHUNK,
        draft_choice: DraftChoice | None = None,
    ) -> None:
        self.max_batch = settle_max_batch(target, max_batch)
        # One at a time, a sequence runs on the pair itself, forwards called directly (any engine, the
        # fixed-shape path included); several need slots of their own (the eager engine).
        self._direct = self.max_batch == 1
        if not self._direct:
            check_batchable(target, drafter)
        self._target, self._drafter, self._chunk = target, drafter, prefill_chunk
        self._draft_choice = draft_choice  # the pair's measured costs, which bound a batch's drafts
        self._caps: dict[int, int] = {}  # batched_draft_len by the number of live sequences
        self._target_model = getattr(target, "model", target)
        self._free: list[Slot] = []
        self._made = 0
        self._live: list[_Live] = []
        self._queue: deque[Work] = deque()
        self._changed = threading.Condition()
        self.peak = 0  # the most sequences one target forward has served

    @property
    def live(self) -> int:
        """Sequences being decoded now."""
        return len(self._live)

    @property
    def queued(self) -> int:
        """Works waiting for a slot."""
        return len(self._queue)

    def add(self, work: Work, room: int | None = None) -> bool:
        """Queue ``work``; it starts at a step when a slot is free. With ``room``, only while fewer than
        ``room`` works wait or decode: returns whether it was queued."""
        with self._changed:
            if room is not None and len(self._queue) + len(self._live) >= room:
                return False
            self._queue.append(work)
            self._changed.notify_all()
        return True

    def withdraw(self, work: Work) -> bool:
        """Take ``work`` out of the queue; False if it is not there (it started, or ended)."""
        with self._changed:
            try:
                self._queue.remove(work)
            except ValueError:
                return False
        return True

    def withdraw_all(self) -> list[Work]:
        """Take every queued work out of the queue; returns them, in order."""
        with self._changed:
            never, self._queue = list(self._queue), deque()
        return never

    def step(self) -> bool:
        """Admit what fits, then run the next model's gathered forwards and advance the sequences that
        waited for them. Returns False when nothing is decoding and nothing is queued."""
        self._admit()
        if not self._live:
            return bool(self._queue)
        self._run_next()
        return True

    def poke(self) -> None:
        """Wake :meth:`wait_for_work` to check its ``wake`` again (call after it may have turned)."""
        with self._changed:
            self._changed.notify_all()

    def wait_for_work(self, timeout: float, wake: Callable[[], bool] | None = None) -> None:
        """Sleep until a work is queued, ``wake`` turns true (see :meth:`poke`) or ``timeout`` seconds
        pass (for an owner with nothing to decode)."""
        with self._changed:
            self._changed.wait_for(lambda: bool(self._queue) or (wake is not None and wake()), timeout)

    def close(self) -> list[Work]:
        """Stop: each live sequence gets :class:`BatchClosed` where it waits for a forward (its work ends
        there), the slots are given back; returns the works that never started."""
        never = self.withdraw_all()
        closed = BatchClosed("the batch was closed before this sequence finished")
        for live in list(self._live):
            self._advance(live, closed)
            if live in self._live:  # it asked for another forward: it ends here
                live.run.close()
                self._end(live)
        done, self._free = self._free, []
        for slot in done:
            slot.release()
        return never

    def _admit(self) -> None:
        joined = []
        while True:
            with self._changed:
                if not (self._queue and (self._free or self._made < self.max_batch)):
                    break
                work = self._queue.popleft()
                slot = self._free.pop() if self._free else None
                if slot is None:
                    slot = self._new_slot()
                    self._made += 1
                live = _Live(slot, work(slot))
                self._live.append(live)  # under the lock: add's room counts it as it leaves the queue
            joined.append(live)
        for live in joined:  # once all have joined: a draft bound reads the batch they make together
            self._advance(live, None)

    def _run_next(self) -> None:
        """Run the forwards of one model that sequences wait for: a drafting model's while any waits,
        else the target's; then advance each of those sequences to its next forward."""
        models = [_model_of(live.request) for live in self._live]
        model = next((m for m in models if m is not self._target_model), models[0])
        group = [live for live, m in zip(self._live, models, strict=True) if m is model]
        outcomes = run_group([self._piece(live) for live in group])
        if model is self._target_model:
            self.peak = max(self.peak, len(group))
        for live, outcome in zip(group, outcomes, strict=True):
            self._take(live, outcome)

    def _piece(self, live: _Live) -> Request:
        """The forward ``live`` runs at this step: its request, or the next chunk of a long one."""
        request = live.request
        assert request is not None
        if live.chunks == 1:
            return request
        assert isinstance(request, Forward) and isinstance(request.lm, SlotLM)
        chunk, at = request.lm.prefill_chunk, len(live.parts)
        return Forward(request.lm, request.tokens[at * chunk : (at + 1) * chunk], request.last_only)

    def _take(self, live: _Live, outcome: Outcome) -> None:
        """Hand ``outcome`` to ``live`` (once its last chunk is scored) and advance it."""
        if isinstance(outcome, BaseException):
            self._advance(live, outcome)
            return
        if len(live.parts) + 1 < live.chunks:
            live.parts.append(outcome)
            return
        request = live.request
        assert request is not None
        if live.parts and not (isinstance(request, Forward) and request.last_only):
            outcome = torch.cat([*live.parts, outcome])
        self._advance(live, outcome)

    def _advance(self, live: _Live, reply: Outcome | None) -> None:
        """Run ``live``'s generation with ``reply`` (logits, or an error thrown into it) up to the next
        forward it asks for; a generation that ends frees its slot."""
        live.parts = []
        try:
            error = isinstance(reply, BaseException)
            request = live.run.throw(reply) if error else live.run.send(reply)  # type: ignore[arg-type]
        except StopIteration:
            self._end(live)
            return
        except Exception:  # a work reports its own failures; this is a bug in one
            log.exception("a batched sequence failed")
            self._end(live)
            return
        live.request = request
        lm = request.lm
        chunked = isinstance(request, Forward) and isinstance(lm, SlotLM)
        live.chunks = lm.chunks(request.tokens) if chunked else 1  # type: ignore[union-attr]

    def _end(self, live: _Live) -> None:
        self._live.remove(live)
        self._free.append(live.slot)  # last: the most recently used slot is reused first

    def _new_slot(self) -> Slot:
        if self._direct:
            return Slot(self._target, self._drafter)
        # Shortened drafts leave an answer as it is only where rows are scored alone.
        cap = self._draft_cap if shares_forwards(self._target) else None
        return make_slot(self._target, self._drafter, self._chunk, cap)

    def _draft_cap(self) -> int:
        live = len(self._live)
        if live not in self._caps:
            self._caps[live] = batched_draft_len(live, self._draft_choice)
        return self._caps[live]


def _model_of(request: Request | None) -> object:
    """The model whose weights ``request``'s forward reads (what forwards are gathered by)."""
    assert request is not None
    return getattr(request.lm, "model", request.lm)
