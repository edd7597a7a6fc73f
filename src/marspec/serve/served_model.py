"""What the routes do with the one model served: complete a request through the engine (answered whole
or streamed as server-sent events), describe the model, report health."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from marspec.api import Decoder, GenerationOptions
from marspec.errors import MarspecError
from marspec.prompting import Prompt, fewest_tokens, longest_token_bytes, render_prompt
from marspec.rules import LOSSLESS_RULES
from marspec.serve.engine import (
    Delta,
    Engine,
    Event,
    Failed,
    Finished,
    Job,
    Outcome,
    StopReason,
    context_length_error,
)
from marspec.serve.errors import ApiError, error_payload
from marspec.serve.metrics import ServerMetrics
from marspec.serve.responses import Responder, sse
from marspec.serve.schemas import ChatCompletionRequest, CompletionRequest, parse_request
from marspec.serve.settings import ServerSettings
from marspec.settings import draft_length

# How often a request waiting for the model checks whether its client is still there.
DISCONNECT_POLL_S = 0.2
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ServedModel:
    """``decoder`` served under ``settings.model_name`` through ``engine``; ``metrics`` is what
    ``/metrics`` reports."""

    def __init__(self, decoder: Decoder, settings: ServerSettings, engine: Engine, metrics: ServerMetrics):
        self.decoder = decoder
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.context_length = decoder.target.context_length
        self.bytes_per_token = longest_token_bytes(decoder.tokenizer)
        self.has_drafter = decoder.drafter is not None
        self.started = int(time.time())
        self.defaults_card = defaults_card(decoder, settings.defaults)

    async def complete(self, request: Request, body: ChatCompletionRequest | CompletionRequest) -> Response:
        """Run one completion request: its JSON response, or an SSE stream when it asks to stream."""
        settings, engine = self.settings, self.engine
        gen = parse_request(body, settings, context_length=self.context_length, has_drafter=self.has_drafter)
        self._refuse_if_surely_too_long(gen.prompt, gen.options.chat)
        try:  # theta="auto": the pair's calibrated setting, echoed in the response as resolved
            gen = replace(gen, options=self.decoder.resolve_theta(gen.options))
        except MarspecError as exc:
            raise ApiError(400, str(exc), param="marspec.theta") from None
        jobs = [
            Job(
                gen.prompt,
                choice_options(gen.options, i),
                timeout=gen.timeout,
                max_tokens_param=gen.max_param,
            )
            for i in range(gen.n)
        ]
        for submitted, job in enumerate(jobs):
            try:
                engine.submit(job)
            except ApiError:  # the queue took only some of the choices: none of them runs
                for earlier in jobs[:submitted]:
                    engine.cancel(earlier, "refused")
                raise
        choices = Choices(jobs)
        out = Responder(
            isinstance(body, ChatCompletionRequest), settings.model_name, gen.options, gen.include_usage
        )
        try:
            if not gen.stream:
                return JSONResponse(out.response(await self._outcomes(request, choices)))
            # Streams too wait for the first event before answering, so that an error found by the
            # worker (a prompt longer than the context, a queue timeout) still gets its status code.
            index, event = await self._next_event(request, choices, first=True)
            if isinstance(event, Failed):
                raise event.error
            return StreamingResponse(
                self._stream_events(choices, index, event, out),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
                # Runs after Starlette saw the client disconnect, too: a second, certain cancel hook.
                background=BackgroundTask(choices.cancel, engine, "disconnect"),
            )
        except BaseException:  # a choice failed, the server cancelled (shutdown timeout) or the client left
            choices.cancel(engine, "disconnect")
            raise

    def model_card(self) -> dict[str, Any]:
        """The model as ``/v1/models`` lists it, with marspec's defaults."""
        return {
            "id": self.settings.model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "marspec",
            "context_length": self.context_length,
            "marspec": self.defaults_card,
        }

    def health(self) -> JSONResponse:
        """200 while requests are accepted; 503 while draining for shutdown or if the worker died."""
        engine = self.engine
        status = "ok" if engine.alive and not engine.draining else "draining" if engine.draining else "down"
        body = {"status": status, "model": self.settings.model_name, "queue_depth": engine.queue_depth}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def _outcomes(self, request: Request, choices: Choices) -> list[Outcome]:
        """Every choice's outcome, in order; a choice's failure is raised."""
        finals: dict[int, Outcome] = {}
        while len(finals) < len(choices.jobs):
            index, event = await self._next_event(request, choices, first=False)
            if isinstance(event, Failed):
                raise event.error
            assert isinstance(event, Finished)
            finals[index] = event.outcome
        return [finals[i] for i in range(len(choices.jobs))]

    async def _next_event(self, request: Request, choices: Choices, first: bool) -> tuple[int, Event]:
        """The choices' next event (``first``) or next final one, with its choice's index. Meanwhile,
        every DISCONNECT_POLL_S (also while deltas keep arriving), check the client is still there; if
        not, cancel the choices, answer 499."""
        checked = time.monotonic()
        while True:
            try:
                index, event = await asyncio.wait_for(choices.events.get(), DISCONNECT_POLL_S)
                if first or not isinstance(event, Delta):
                    return index, event
            except TimeoutError:
                pass
            if time.monotonic() - checked >= DISCONNECT_POLL_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    choices.cancel(self.engine, "disconnect")
                    raise ApiError(499, "the client closed the request", code="client_closed_request")

    def _refuse_if_surely_too_long(self, prompt: Prompt, chat: bool | None) -> None:
        """Refuse a prompt whose byte count alone proves it cannot fit the context, here on the event
        loop, so that it never occupies the worker with tokenizing it (the worker counts exactly)."""
        decoder, context_length = self.decoder, self.context_length
        if not context_length:
            return
        chat = decoder.chat_default if chat is None else chat
        try:
            text, _ = render_prompt(decoder.tokenizer, prompt, chat, decoder.target.name)
        except MarspecError:
            return  # the worker reports it, naming the parameter
        fewest = fewest_tokens(text, self.bytes_per_token)
        if fewest >= context_length:
            param = "prompt" if isinstance(prompt, str) else "messages"
            raise context_length_error(context_length, f"at least {fewest:,}", param)

    async def _stream_events(
        self, choices: Choices, index: int, event: Event, out: Responder
    ) -> AsyncIterator[bytes]:
        """The choices' chunks, each tagged with its choice's index, from ``event`` (choice ``index``'s)
        on; usage once every choice has ended. A choice's failure ends the stream with an error event."""
        n = len(choices.jobs)
        sent = [0] * n  # log probabilities each choice's text chunks carried
        outcomes: dict[int, Outcome] = {}
        try:
            for chunk in out.opening_chunks(n):
                yield sse(chunk)
            while True:
                if isinstance(event, Delta):
                    sent[index] += len(event.logprobs)
                    yield sse(out.text_chunk(index, event.text, event.logprobs))
                elif isinstance(event, Finished):
                    outcomes[index] = event.outcome
                    unsent = (event.outcome.logprobs or ())[sent[index] :]
                    yield sse(out.closing_chunk(index, event.outcome, unsent))
                    if len(outcomes) == n:
                        for chunk in out.usage_chunk([outcomes[i] for i in range(n)]):
                            yield sse(chunk)
                        break
                else:  # failed after the response started (shutdown, or a bug): an OpenAI error event
                    yield sse(error_payload(event.error))
                    break
                index, event = await choices.events.get()
            yield sse("[DONE]")
        finally:  # the client went away (Starlette cancelled or closed this generator), or a choice failed
            if len(outcomes) < n:
                choices.cancel(self.engine, "disconnect")


class Choices:
    """A request's jobs, one per choice, their events merged into one queue as ``(choice index,
    event)``. Create it on the event loop that reads ``events``, once every job is submitted."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs
        self.events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        # Each forwarder ends with its job's final event, which every submitted job posts.
        self._forwarders = [asyncio.create_task(self._forward(i, job)) for i, job in enumerate(jobs)]

    async def _forward(self, index: int, job: Job) -> None:
        while True:
            event = await job.events.get()
            self.events.put_nowait((index, event))
            if not isinstance(event, Delta):
                return

    def cancel(self, engine: Engine, reason: StopReason) -> None:
        """Stop every choice that has not ended."""
        for job in self.jobs:
            engine.cancel(job, reason)


def choice_options(options: GenerationOptions, index: int) -> GenerationOptions:
    """Choice ``index``'s options: its own seed, ``seed + index`` when the request gives one (so choice 0
    is the answer of the same request with n = 1); without one each choice draws its own."""
    return options if options.seed is None else replace(options, seed=options.seed + index)


def defaults_card(decoder: Decoder, defaults: GenerationOptions) -> dict[str, Any]:
    """What a request that sets no ``marspec`` field gets: the rule, whether it is lossless, k, and for a
    lossy rule the margin and theta it decodes with when greedy and when sampling (they may differ, by
    measurement or by calibration)."""
    lossless = defaults.rule in LOSSLESS_RULES
    k = draft_length(defaults.k, decoder.pair)  # unset: the length chosen for this machine
    card: dict[str, Any] = {"rule": defaults.rule, "lossless": lossless, "k": k}
    if lossless:
        return card  # a margin or theta would mean nothing to it
    for regime, temperature in (("greedy", 0.0), ("sampling", 1.0)):
        try:
            resolved = decoder.resolve_theta(replace(defaults, temperature=temperature))
        except MarspecError as exc:  # theta="auto" with no calibration for this regime
            card[regime] = {"error": str(exc)}
            continue
        card[regime] = {"margin": resolved.margin, "theta": resolved.theta}
    return card
