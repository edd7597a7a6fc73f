"""Threads and torch's thread count: loading in a passing thread, so that the thread that decodes holds the
process's only OpenMP team, and a thread's own count set so that it stays its own.

torch runs its parallel regions with OpenMP, and libgomp keeps a team of worker threads for each thread
that opens one, for as long as that thread lives. Once a process holds more team threads than cores,
every team's workers stop spinning between regions and each region pays a wake-up: the hundreds of
small regions of a forward then cost ~1.5x more (the default pair decoded 12.1 tok/s in a second thread
after loading in the first, 17.7 after loading in a thread that had ended; docs/results.md, "Several
users at once"). Loading runs parallel regions (quantising, packing weights) in whichever thread loads,
and a server decodes in a thread of its own: loading in a thread that ends with the load frees its team.

torch keeps one thread count per thread, but takes it from the process's last ``set_num_threads`` call
(whichever thread made it) when the thread first needs it: its first parallel region, or its first
``get_num_threads``. A thread that sets its count and runs its first forward only after another thread
set another count runs with that other count (a server's forwards ran on one core, the count its
sequences' threads set for themselves): :func:`hold_thread_count` sets a thread's count and fixes it
at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def hold_thread_count(count: int) -> None:
    """Run this thread's torch work on ``count`` threads from now on, whatever other threads set later."""
    torch.set_num_threads(count)
    torch.get_num_threads()  # the thread's first read fixes its count: the one just set


def in_passing_thread(work: Callable[[], T]) -> T:
    """``work()`` run in a new thread that ends with it, at the caller's torch thread count; its result,
    or its exception raised here."""
    threads = torch.get_num_threads()
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        hold_thread_count(threads)  # the caller's count, not whatever another thread set last
        try:
            outcome.append(work())
        except BaseException as exc:  # handed to the caller, whatever it is
            failure.append(exc)

    # A daemon thread, so that an interrupted load does not keep the process alive.
    thread = threading.Thread(target=run, name="marspec-load", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
