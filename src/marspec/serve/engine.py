"""The engine: requests decoded together, up to ``max_batch`` at a time, from a bounded queue.

The HTTP side never touches the model (or its tokenizer): it submits a :class:`Job` and reads the job's
events (text deltas, then exactly one :class:`Finished` or :class:`Failed`) from an asyncio queue that
the engine fills through the event loop. A job is a work of the :class:`marspec.batch.scheduler.Scheduler`,
whose queue is the only one: admission (429 when full), withdrawal of a job cancelled or timed out while
it waits, and shutdown all act on it. One worker thread steps the scheduler: it admits queued jobs
between decode steps, each into a slot (its own KV caches), runs the model forwards they gather and
advances each job's decode loop, so a job joins and leaves the batch without disturbing the others
(continuous batching). Stopping a running job (client gone, time limit, shutdown) only sets a flag; the
job reads it after each text delta and ends its generation there, between two steps, so no cache is
left midway through a step: the slot's next job keeps what it shares with the last one
(``reuse_prefix``) and scores the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from marspec.api import Decoder, GenerationOptions, TokenLogprob
from marspec.batch.many import relay
from marspec.batch.scheduler import BatchClosed, Scheduler, Work
from marspec.batch.slots import Slot
from marspec.errors import ChatTemplateError, MarspecError, ModelOutputError
from marspec.forward_requests import Request
from marspec.prompting import Prompt, encode_prompt
from marspec.serve.errors import ApiError
from marspec.serve.logprobs import TokenEntry, token_entries
from marspec.serve.metrics import ServerMetrics

log = logging.getLogger("marspec.serve")

# "refused": a sibling choice of the same request was refused (429), so its answer will never be sent.
StopReason = Literal["disconnect", "timeout", "shutdown", "refused"]
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Outcome:
    """A generation that produced a response (it ran to its end, or to the request's time limit).

    ``stats`` is ``GenerationStats.to_dict()``; it is ``None`` for a timed-out generation, whose
    acceptance counters the library does not return once a stream is closed early (then
    ``completion_tokens`` is the re-tokenized length of ``text``). ``logprobs``: every generated token's,
    when the request asked for them (else None).
    """

    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, Any] | None
    relaxed_positions: list[int]
    timed_out: bool
    queue_s: float
    logprobs: tuple[TokenEntry, ...] | None = None


@dataclass(frozen=True)
class Delta:
    """New text, in order, and the log probabilities of the tokens decoded since the last delta (when
    the request asked for them; a token whose text is still held back comes with it)."""

    text: str
    logprobs: tuple[TokenEntry, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The last event of a job that produced a response."""

    outcome: Outcome


@dataclass(frozen=True)
class Failed:
    """The last event of a job that produced none: ``error`` is a MarspecError (bad input, 400), an
    ApiError (its own status) or any other exception (a server bug, 500)."""

    error: Exception


Event = Delta | Finished | Failed


class Job:
    """One request's generation: its input, its time limit, and the events the worker sends back.

    Create it on the event loop that will read ``events``.
    """

    def __init__(
        self,
        prompt: Prompt,
        options: GenerationOptions,
        *,
        timeout: float | None,
        max_tokens_param: str | None = None,
    ) -> None:
        self.prompt = prompt
        self.options = options
        # The request parameter that set options.max_new_tokens (None: the server's default): a prompt
        # that leaves less room than it asks for is refused, naming it.
        self.max_tokens_param = max_tokens_param
        self.arrived = time.monotonic()
        self.deadline = None if timeout is None else self.arrived + timeout
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        # Set from any thread, read by the worker between decode steps: a plain attribute suffices.
        self.stop_reason: StopReason | None = None
        self.work: Work | None = None  # what the engine's scheduler runs for it, once submitted

    def at_deadline(self, callback: Callable[[Job], None]) -> None:
        """Call ``callback(self)`` on the job's event loop once its deadline has passed; safe from any
        thread."""
        assert self.deadline is not None
        deadline = self.deadline

        def schedule() -> None:
            self._loop.call_later(max(0.0, deadline - time.monotonic()), callback, self)

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for an answer
            self._loop.call_soon_threadsafe(schedule)

    def post(self, event: Event) -> None:
        """Hand an event to the job's reader; safe from any thread."""
        # A closed event loop raises RuntimeError: the server is gone and nobody is listening.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    """Serves :class:`Job` s, up to ``max_batch`` decoded together (None: the pair's default,
    :func:`marspec.batch.scheduler.settle_max_batch`), from a worker thread that owns ``decoder``'s
    models.

    At most ``max_queue`` jobs wait while ``max_batch`` run; :meth:`submit` refuses more with a 429.
    After :meth:`begin_shutdown`, new jobs are refused (503) and queued or running ones may still finish
    for ``shutdown_grace`` seconds; then they are cancelled. :meth:`close` cancels everything and joins
    the worker.
    """

    def __init__(
        self,
        decoder: Decoder,
        *,
        max_queue: int,
        shutdown_grace: float,
        metrics: ServerMetrics | None = None,
        max_batch: int | None = None,
    ) -> None:
        self._decoder = decoder
        self._max_queue = max_queue
        self._grace = shutdown_grace
        self._metrics = metrics
        self._scheduler = Scheduler(
            decoder.target, decoder.drafter, max_batch, draft_choice=decoder.draft_choice
        )
        self.max_batch = self._scheduler.max_batch
        self._jobs: dict[Work, Job] = {}  # each submitted job's work, until it ends
        self._closed = False
        # Written by a signal handler, so without a lock (the interrupted thread may hold it).
        self._drain_deadline: float | None = None
        self._service_s = 1.0  # moving average of a generation's duration, for Retry-After
        self._thread = threading.Thread(target=self._run, name="marspec-engine", daemon=True)
        if metrics is not None:
            metrics.track(
                lambda: self.queue_depth,
                lambda: self.busy,
                lambda: self.batch_size,
                lambda: self._scheduler.peak,
            )

    def start(self) -> None:
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for the model (not counting the running ones)."""
        return self._scheduler.queued

    @property
    def busy(self) -> bool:
        """Whether some job is being decoded."""
        return self._scheduler.live > 0

    @property
    def batch_size(self) -> int:
        """Jobs being decoded together now."""
        return self._scheduler.live

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None or self._closed

    def retry_after(self) -> int:
        """Whole seconds until a queue slot is likely to free up: about one generation per batch."""
        return max(1, math.ceil(self._service_s / self.max_batch))

    def submit(self, job: Job) -> None:
        """Queue ``job``, or raise ApiError: 429 when the queue is full, 503 when shutting down."""
        if self.draining:
            raise ApiError(
                503, "the server is shutting down: send the request elsewhere", code="shutting_down"
            )
        if not self.alive:
            raise ApiError(503, "the generation worker is not running", code="worker_stopped")
        work = job.work = self._work(job)
        self._jobs[work] = job
        if not self._scheduler.add(work, room=self._max_queue + self.max_batch):
            del self._jobs[work]
            job.work = None
            raise ApiError(
                429,
                f"the server is busy: {self.queue_depth} request(s) already wait for the model "
                f"beside the {self.batch_size} being decoded (--max-queue {self._max_queue}, "
                f"--max-batch {self.max_batch}); retry after the Retry-After header's seconds",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after())},
            )
        if job.deadline is not None:
            job.at_deadline(self._expire_if_queued)

    def cancel(self, job: Job, reason: StopReason) -> None:
        """Stop ``job``: at once if it is still queued, else at the worker's next decode step. A job that
        already ended is left alone."""
        if job.stop_reason is None:
            job.stop_reason = reason
        if self._withdraw(job):  # else running (the job will see the flag) or already done
            self._stop(job, job.stop_reason)

    def _expire_if_queued(self, job: Job) -> None:
        """At ``job``'s deadline: answer it (503) if it still waits in the queue, rather than when a slot
        frees (the worker may be busy with a long generation for minutes)."""
        if self._withdraw(job):  # else running (the job checks its deadline) or already done
            self._stop(job, "timeout")

    def _withdraw(self, job: Job) -> bool:
        """Take ``job`` out of the queue if it still waits there; whether it did."""
        if job.work is None or not self._scheduler.withdraw(job.work):
            return False
        self._jobs.pop(job.work, None)
        return True

    def begin_shutdown(self) -> None:
        """Refuse new jobs; let current ones run for the grace period. Safe inside a signal handler."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self._grace

    def close(self, timeout: float = 30.0) -> None:
        """Cancel queued and running jobs and wait (up to ``timeout`` s) for the worker to exit."""
        self.begin_shutdown()
        self._closed = True
        self._drop(self._scheduler.withdraw_all())
        self._scheduler.poke()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the worker thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        """The dispatcher: admit jobs as slots free up and run the forwards the running ones gather,
        until closed with nothing left running."""
        scheduler = self._scheduler
        try:
            while not (self._closed and not scheduler.live and not scheduler.queued):
                if not scheduler.step():
                    scheduler.wait_for_work(0.5, wake=lambda: self._closed)
        finally:
            self._drop(scheduler.close())

    def _drop(self, works: list[Work]) -> None:
        """End the jobs of ``works``, which never started (the server shuts down)."""
        for work in works:
            job = self._jobs.pop(work, None)
            if job is not None:
                job.stop_reason = job.stop_reason or "shutdown"
                self._stop(job, job.stop_reason)

    def _work(self, job: Job) -> Work:
        """What decodes ``job`` on a slot, advanced by the scheduler (every outcome ends in one final
        event)."""

        def run(slot: Slot) -> Generator[Request, torch.Tensor, None]:
            try:
                yield from self._serve(job, slot)
            except BatchClosed:
                self._stop(job, "shutdown")
            except ModelOutputError as exc:  # the model's fault, not the request's: a 500 that says so
                log.error("generation failed: %s", exc)
                self._finish(job, "failed", Failed(exc))
            except (MarspecError, ApiError) as exc:
                self._finish(job, "rejected", Failed(exc))
            except Exception as exc:  # a bug: answer 500 and keep serving the other requests
                log.exception("generation failed")
                self._finish(job, "failed", Failed(exc))
            finally:
                self._jobs.pop(run, None)

        return run

    def _stop_reason(self, job: Job) -> StopReason | None:
        now = time.monotonic()
        if job.stop_reason is not None:
            return job.stop_reason
        if job.deadline is not None and now >= job.deadline:
            return "timeout"
        if self._closed or (self._drain_deadline is not None and now >= self._drain_deadline):
            return "shutdown"
        return None

    def _serve(self, job: Job, slot: Slot) -> Generator[Request, torch.Tensor, None]:
        started = time.monotonic()
        queue_s = started - job.arrived
        if self._metrics is not None:
            self._metrics.queue_wait.observe(queue_s)
        reason = self._stop_reason(job)
        if reason is not None:  # cancelled, timed out or shut down while queued
            self._stop(job, reason)
            return
        prompt_tokens = self._check_prompt(job)
        logprobs: list[TokenLogprob] = []
        parts: list[str] = []
        entries: list[TokenEntry] = []  # the log probabilities sent so far, as text

        def on_text(delta: str) -> bool:
            nonlocal reason
            if not parts and self._metrics is not None:
                self._metrics.time_to_first_token.observe(time.monotonic() - job.arrived)
            parts.append(delta)
            new = token_entries(self._decoder.tokenizer, logprobs[len(entries) :])
            entries.extend(new)
            job.post(Delta(delta, new))
            reason = self._stop_reason(job)
            return reason is None

        generation = self._decoder.decode_on(slot, job.prompt, job.options, True, logprobs)
        # Stopped by ``on_text``, the generation ends between two steps (relay closes it).
        result = yield from relay(generation, on_text)
        if reason in (None, "timeout"):  # the model was busy for a whole request: what a queue slot costs
            self._service_s = 0.8 * self._service_s + 0.2 * (time.monotonic() - started)
        if reason is None:
            assert result is not None  # the generation ran to its end
            outcome = Outcome(
                text=result.text,
                finish_reason="length" if result.finish_reason == "length" else "stop",
                prompt_tokens=result.stats.prompt_tokens,
                completion_tokens=result.stats.new_tokens,
                stats=result.stats.to_dict(),
                relaxed_positions=result.relaxed_positions,
                timed_out=False,
                queue_s=queue_s,
                logprobs=self._logprobs(job, entries, logprobs),
            )
            self._finish(job, "completed", Finished(outcome))
        elif reason == "timeout":
            text = "".join(parts)
            completion_tokens = len(self._decoder.tokenizer(text, add_special_tokens=False).input_ids)
            sent = self._logprobs(job, entries, logprobs)
            outcome = Outcome(text, "length", prompt_tokens, completion_tokens, None, [], True, queue_s, sent)
            self._finish(job, "timed_out", Finished(outcome))
        else:
            self._stop(job, reason, prompt_tokens)

    def _logprobs(
        self, job: Job, sent: list[TokenEntry], decoded: list[TokenLogprob]
    ) -> tuple[TokenEntry, ...] | None:
        """Every decoded token's log probabilities as text (those not sent in a delta made now), or None
        when the request did not ask for them."""
        if job.options.logprobs is None:
            return None
        return (*sent, *token_entries(self._decoder.tokenizer, decoded[len(sent) :]))

    def _check_prompt(self, job: Job) -> int:
        """Count the prompt's tokens and refuse one that does not fit the context with OpenAI's error code
        (the library would refuse it too, but without a code clients can act on)."""
        chat = self._decoder.chat_default if job.options.chat is None else job.options.chat
        target = self._decoder.target
        param = "prompt" if isinstance(job.prompt, str) else "messages"
        try:
            n = int(encode_prompt(self._decoder.tokenizer, job.prompt, chat, target.name).shape[0])
        except ChatTemplateError as exc:  # a 400 like any MarspecError, but naming the parameter
            raise ApiError(400, str(exc), param=param) from None
        context = target.context_length
        if context and n >= context:
            raise context_length_error(context, f"{n}", param)
        wanted = job.options.max_new_tokens
        if context and job.max_tokens_param is not None and n + wanted > context:
            limit = job.max_tokens_param
            raise ApiError(
                400,
                f"this model's maximum context length is {context} tokens and {n + wanted} were asked for "
                f"({n} in the {param}, {wanted} in {limit}): set {limit} to at most {context - n} or "
                "shorten the prompt",
                param=limit,
                code="context_length_exceeded",
            )
        return n

    def _stop(self, job: Job, reason: StopReason, prompt_tokens: int = 0) -> None:
        """End a job that produces no response."""
        if reason == "timeout":  # still queued at its deadline: the server is overloaded
            error = ApiError(
                503,
                "the request timed out waiting for the model (the server is overloaded): retry later",
                code="queue_timeout",
                headers={"Retry-After": str(self.retry_after())},
            )
            self._finish(job, "timed_out", Failed(error), prompt_tokens)
        elif reason == "shutdown":
            error = ApiError(503, "the server shut down before the generation finished", code="shutting_down")
            self._finish(job, "cancelled_shutdown", Failed(error), prompt_tokens)
        elif reason == "refused":  # nobody reads this answer either: the request was answered 429
            error = ApiError(429, "another choice of the request found the queue full", code="queue_full")
            self._finish(job, "cancelled_refused", Failed(error), prompt_tokens)
        else:  # nobody reads this answer; it only keeps "every job ends with one final event" true
            error = ApiError(499, "the client closed the request", code="client_closed_request")
            self._finish(job, "cancelled_disconnect", Failed(error), prompt_tokens)

    def _finish(self, job: Job, label: str, event: Finished | Failed, prompt_tokens: int = 0) -> None:
        if self._metrics is not None:
            if isinstance(event, Finished):
                o = event.outcome
                self._metrics.observe_generation(label, o.prompt_tokens, o.completion_tokens, o.stats)
            else:
                self._metrics.observe_generation(label, prompt_tokens, 0, None)
        job.post(event)


def context_length_error(context_length: int, prompt_tokens: str, param: str) -> ApiError:
    """The 400 for a prompt that leaves no room in the context (``prompt_tokens`` as said to the user)."""
    return ApiError(
        400,
        f"this model's maximum context length is {context_length} tokens and the prompt has "
        f"{prompt_tokens}: shorten it",
        param=param,
        code="context_length_exceeded",
    )
