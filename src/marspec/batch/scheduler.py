"""Sequences decoded side by side: admitted between forwards, each on a slot of its own, in its own thread.

A :class:`Scheduler` holds up to ``max_batch`` slots. A work (one sequence's whole generation, a callable
taking its slot) waits in a queue until a slot is free, then runs in a thread of its own while the
scheduler's owner calls :meth:`Scheduler.step` (the dispatcher: it admits works and runs the gathered
forwards, :mod:`marspec.batch.batcher`). A work that ends (its sequence finished, was cancelled or failed)
frees its slot for the next one at once: continuous batching, as servers call it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable

import torch

from marspec.backends.hf import HFCausalLM
from marspec.backends.threads import hold_thread_count
from marspec.batch.batcher import BatchClosed, Batcher
from marspec.batch.slots import Slot, batched_form, check_batchable, make_slot
from marspec.defaults import MAX_K
from marspec.errors import MarspecError
from marspec.interfaces import CausalLM, Drafter

log = logging.getLogger("marspec.batch")

Work = Callable[[Slot], None]

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


def batched_draft_len(sequences: int) -> int:
    """The most tokens each of ``sequences`` decoded together drafts where its answer does not depend on
    its drafts: the batch's verification rows near :data:`BATCH_VERIFY_ROWS`, and none below two (a
    one-token draft costs a draft step for at most one token). One sequence alone keeps its own k."""
    if sequences <= 1:
        return MAX_K
    per_sequence = BATCH_VERIFY_ROWS // sequences - 1
    return per_sequence if per_sequence >= 2 else 0


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


def check_max_batch(max_batch: object) -> int:
    """``max_batch`` checked: an integer >= 1 (a one-line error otherwise)."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise MarspecError(
            f"max_batch (sequences decoded together) must be an integer >= 1, got {max_batch!r}"
        )
    return max_batch


class Scheduler:
    """Decodes works side by side on up to ``max_batch`` slots of the pair ``target`` + ``drafter``.

    Thread use: :meth:`add` from any thread; :meth:`step` and :meth:`close` from one thread, the
    dispatcher's, which runs every model forward.
    """

    def __init__(
        self,
        target: HFCausalLM,
        drafter: Drafter | None,
        max_batch: int,
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> None:
        self.max_batch = check_max_batch(max_batch)
        # One at a time, a sequence runs on the pair itself, forwards called directly (any engine, the
        # fixed-shape path included); several need slots of their own (the eager engine).
        self._direct = self.max_batch == 1
        if not self._direct:
            check_batchable(target, drafter)
        self._target, self._drafter, self._chunk = target, drafter, prefill_chunk
        self._batcher = Batcher(target.model)
        self._free: list[Slot] = []
        self._made = 0
        self._queue: deque[Work] = deque()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @property
    def peak(self) -> int:
        """The most sequences one target forward has served so far."""
        return self._batcher.peak

    def add(self, work: Work) -> None:
        """Queue ``work``; it starts at a step when a slot is free."""
        with self._lock:
            self._queue.append(work)
        self._batcher.poke()

    def step(self, timeout: float = 0.1, wake: Callable[[], bool] | None = None) -> bool:
        """Admit what fits, then run the next gathered forward once every sequence waits for one (at most
        ``timeout`` seconds of waiting; ``wake``, when it turns true, ends the wait too: work the owner
        holds for admission). Returns False when nothing is decoding and nothing is queued."""
        self._admit()
        batcher = self._batcher
        if not batcher.members:
            return bool(self._queue)

        def done_waiting() -> bool:
            woken = wake is not None and wake()
            return batcher.ready() or self._admissible() or not batcher.members or woken

        batcher.wait_until(done_waiting, timeout)
        if not self._admissible():
            batcher.run_once()
        return True

    def poke(self) -> None:
        """Wake a :meth:`step` that waits, to check its ``wake`` again (call after it may have turned)."""
        self._batcher.poke()

    def wait_for_work(self, timeout: float, wake: Callable[[], bool] | None = None) -> None:
        """Sleep until a work is queued, ``wake`` turns true (see :meth:`poke`) or ``timeout`` seconds
        pass (for a dispatcher with nothing to do)."""
        self._batcher.wait_until(lambda: bool(self._queue) or (wake is not None and wake()), timeout)

    def close(self, timeout: float = 30.0) -> list[Work]:
        """Stop: sequences waiting for a forward fail with :class:`BatchClosed` (works end at their next
        forward), threads are joined, the slots given back; returns the works that never started."""
        with self._lock:
            never, self._queue = list(self._queue), deque()
        self._batcher.close(BatchClosed("the batch was closed before this sequence finished"))
        for thread in self._threads:
            thread.join(timeout)
        with self._lock:  # a slot whose thread outlived the wait stays held: its sequence may still write
            done, self._free = self._free, []
        for slot in done:
            slot.release()
        return never

    def _admissible(self) -> bool:
        return bool(self._queue) and (bool(self._free) or self._made < self.max_batch)

    def _admit(self) -> None:
        while self._admissible():
            with self._lock:
                work = self._queue.popleft()
                slot = self._free.pop() if self._free else None
            if slot is None:
                slot = self._new_slot()
                self._made += 1
            self._batcher.join()
            if self._direct:  # one at a time: the sequence runs here, in the thread that runs forwards
                self._run(work, slot)
                continue
            self._start_member(work, slot)

    def _start_member(self, work: Work, slot: Slot) -> None:
        """Run ``work`` in a thread of its own, on one torch thread: its torch work (verification,
        drafting decisions) is small, and every thread that opens OpenMP parallel regions keeps a team of
        worker threads of its own; once they outnumber the cores libgomp stops spinning between regions,
        which made the dispatcher's forwards up to 2x slower (docs/results.md, "Several users at once").
        Setting a count is also the process's default for threads yet to read theirs
        (:mod:`marspec.backends.threads`), so the dispatcher's count is set back once the member holds its
        own."""
        dispatcher_threads = torch.get_num_threads()
        holding = threading.Event()

        def member() -> None:
            hold_thread_count(1)
            holding.set()
            self._run(work, slot)

        thread = threading.Thread(target=member, name="marspec-seq", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        holding.wait()
        torch.set_num_threads(dispatcher_threads)

    def _new_slot(self) -> Slot:
        if self._direct:
            return Slot(self._target, self._drafter)
        # Shortened drafts leave an answer as it is only where rows are scored alone.
        cap = self._draft_cap if shares_forwards(self._target) else None
        return make_slot(self._target, self._drafter, self._batcher, self._chunk, cap)

    def _draft_cap(self) -> int:
        return batched_draft_len(self._batcher.members)

    def _run(self, work: Work, slot: Slot) -> None:
        try:
            work(slot)
        except BaseException:  # a work reports its own failures; this is a bug in one
            log.exception("a batched sequence failed")
        finally:
            with self._lock:
                self._free.append(slot)  # last: the most recently used slot is reused first
            self._batcher.leave()
