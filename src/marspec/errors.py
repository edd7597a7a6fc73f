"""Errors a user can act on.

Every problem caused by input (a bad name, a value out of range, a missing file) is raised as a
:class:`MarspecError` whose message names the problem and the fix in one line. The CLI prints that line
and exits with status 2; library callers can catch the class.
"""

from __future__ import annotations


class MarspecError(ValueError):
    """A user-facing error: the message says what is wrong and how to fix it."""


class ChatTemplateError(MarspecError):
    """The model's chat template refused the messages (e.g. roles that do not alternate)."""
