"""What a server is started with: the served model's name, generation defaults and load limits."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from marspec.api import GenerationOptions
from marspec.errors import MarspecError


@dataclass(frozen=True)
class ServerSettings:
    """Server-wide configuration (the ``marspec serve`` flags).

    Attributes:
        model_name: the name clients pass as ``model`` (and ``/v1/models`` lists).
        defaults: generation options for fields a request leaves out; ``max_new_tokens`` is the default
            ``max_tokens``.
        max_queue: requests that may wait while ``max_batch`` generate; more are answered 429.
        max_batch: requests decoded together (continuous batching; :mod:`marspec.batch`); ``None``: the
            pair's default (:func:`marspec.batch.scheduler.default_max_batch`).
        request_timeout: seconds from a request's arrival until it is stopped (``None``: no limit). A
            generation that runs out of time ends with what it produced so far (finish_reason "length",
            ``marspec.timed_out``); a request still waiting in the queue is answered 503.
        shutdown_grace: seconds in-flight and queued work may still run after SIGTERM before it is
            cancelled.
        max_request_bytes: the largest request body accepted; a larger one is answered 413 before it
            is parsed.
        api_key: when set, every request but ``GET /health`` must carry ``Authorization: Bearer
            <api_key>`` or is answered 401 (:mod:`marspec.serve.auth`); ``None`` serves anyone.
    """

    model_name: str
    defaults: GenerationOptions = field(default_factory=GenerationOptions)
    max_queue: int = 8
    max_batch: int | None = None
    request_timeout: float | None = 300.0
    shutdown_grace: float = 20.0
    max_request_bytes: int = 4 * 2**20
    api_key: str | None = field(default=None, repr=False)  # never in a log line

    def __post_init__(self) -> None:
        if not self.model_name.strip():
            raise MarspecError("the served model name must not be blank")
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise MarspecError(f"--max-queue must be an integer >= 0, got {self.max_queue!r}")
        if self.max_batch is not None and (
            isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1
        ):
            raise MarspecError(f"--max-batch must be an integer >= 1, got {self.max_batch!r}")
        if self.request_timeout is not None and not _positive(self.request_timeout):
            raise MarspecError(
                f"--request-timeout must be a number of seconds > 0, got {self.request_timeout}"
            )
        if not (_positive(self.shutdown_grace) or self.shutdown_grace == 0):
            raise MarspecError(
                f"--shutdown-grace must be a number of seconds >= 0, got {self.shutdown_grace}"
            )
        if isinstance(self.max_request_bytes, bool) or not (
            isinstance(self.max_request_bytes, int) and self.max_request_bytes >= 1024
        ):
            raise MarspecError(
                f"--max-request-mb must be at least 0.001 (1 KB), got {self.max_request_bytes / 2**20:g}"
            )
        # A bearer key travels in an HTTP header: printable ASCII without spaces (RFC 6750's token68).
        if self.api_key is not None and not (
            isinstance(self.api_key, str) and re.fullmatch(r"[!-~]+", self.api_key)
        ):
            raise MarspecError(
                "--api-key (or MARSPEC_API_KEY) must be a non-empty string of printable ASCII without "
                "spaces, e.g. the output of: python -c 'import secrets; print(secrets.token_urlsafe())'"
            )


def _positive(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0
