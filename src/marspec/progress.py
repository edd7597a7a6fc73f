"""Progress for long CLI runs: a live bar in a terminal, plain dated lines in a log.

A rich bar redraws one line in place; written to a file or a CI log it shows nothing until it ends and
then leaves a single cryptic line. So when stderr is not a terminal, each finished item is one line.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

_DONE_BEFORE = " (done before)"


class Advance(Protocol):
    def __call__(self, description: str, skipped: bool = False) -> None:
        """One item finished; ``skipped`` when a resumed run found it done before: it counts toward the
        total, is marked "(done before)", and does not count toward the time each item takes."""


@contextmanager
def progress(console: Console, title: str, total: int, *, eta: bool = False) -> Iterator[Advance]:
    """Yield an :class:`Advance`, to be called once per item of ``total``."""
    if console.is_terminal:
        description = TextColumn("{task.description}", markup=False)  # item names are text, not markup
        columns = [description, BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        if eta:
            columns += [TextColumn("ETA"), TimeRemainingColumn()]
        with Progress(*columns, console=console) as bar:
            task = bar.add_task(title, total=total)

            def advance_bar(description: str, skipped: bool = False) -> None:
                bar.update(task, advance=1, description=description + _DONE_BEFORE * skipped)

            yield advance_bar
        return

    start = time.monotonic()
    done = 0
    worked = 0  # items that took their time (not skipped): only they predict the rest
    console.print(f"{title}: {total} planned", highlight=False, soft_wrap=True)

    def log_line(description: str, skipped: bool = False) -> None:
        nonlocal done, worked
        done += 1
        worked += not skipped
        elapsed = time.monotonic() - start
        line = f"[{done}/{total}] {description}{_DONE_BEFORE * skipped}  ({_clock(elapsed)} elapsed"
        if eta and done < total and worked:
            line += f", ~{_clock(elapsed / worked * (total - done))} left"
        console.print(line + ")", highlight=False, soft_wrap=True)

    yield log_line


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


@contextmanager
def status(console: Console, message: str) -> Iterator[None]:
    """A spinner in a terminal; in a log, one line with the step's duration once it succeeded (a failed
    step leaves only its error, which stays a single line)."""
    if console.is_terminal:
        with console.status(Text(message)):  # a path's "[...]" is text, not rich markup
            yield
        return
    start = time.monotonic()
    yield
    console.print(f"{message}: done in {time.monotonic() - start:.1f} s", highlight=False, soft_wrap=True)
