"""Errors a user can act on.

Every problem caused by input (a bad name, a value out of range, a missing file) is raised as a
:class:`MarspecError` whose message names the problem and the fix in one line. The CLI prints that line
and exits with status 2; library callers can catch the class.
"""

from __future__ import annotations


class MarspecError(ValueError):
    """A user-facing error: the message says what is wrong and how to fix it. ``field``, when set, names
    the option at fault (e.g. ``"theta"``), for callers that report it apart, like the server's 400s."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def one_line(exc: BaseException) -> str:
    """An exception as one short line (its type and the first line of its message), for a
    :class:`MarspecError` that names a lower-level failure."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


class ChatTemplateError(MarspecError):
    """The model's chat template refused the messages (e.g. roles that do not alternate)."""


class ModelOutputError(MarspecError):
    """The model produced values nothing can be decoded from (NaN or infinite probabilities): a problem of
    the model, its weights or its precision rather than of the request (the server answers it with a 500
    that says so). Raised before a token is taken from them."""
