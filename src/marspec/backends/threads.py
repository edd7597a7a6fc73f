"""Loading in a passing thread, so that the thread that decodes holds the process's only OpenMP team.

torch runs its parallel regions with OpenMP, and libgomp keeps a team of worker threads for each thread
that opens one, for as long as that thread lives. Once a process holds more team threads than cores,
every team's workers stop spinning between regions and each region pays a wake-up: the hundreds of
small regions of a forward then cost ~1.5x more (the default pair decoded 12.1 tok/s in a second thread
after loading in the first, 17.7 after loading in a thread that had ended; docs/results.md, "Several
users at once"). Loading runs parallel regions (quantising, packing weights) in whichever thread loads,
and a server decodes in a thread of its own: loading in a thread that ends with the load frees its team.
A batch decodes every sequence in the one thread that steps it (:mod:`marspec.batch.scheduler`), so no
other thread opens a team.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def in_passing_thread(work: Callable[[], T]) -> T:
    """``work()`` run in a new thread that ends with it, at the caller's torch thread count; its result,
    or its exception raised here."""
    threads = torch.get_num_threads()
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        # The caller's count: a new thread takes the count last set anywhere in the process.
        torch.set_num_threads(threads)
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
