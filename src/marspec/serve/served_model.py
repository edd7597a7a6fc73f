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
from marspec.serve.engine import Delta, Engine, Event, Failed, Finished, Job, context_length_error
from marspec.serve.errors import ApiError, error_payload
from marspec.serve.metrics import ServerMetrics
from marspec.serve.responses import Responder, sse
from marspec.serve.schemas import ChatCompletionRequest, CompletionRequest, parse_request
from marspec.serve.settings import ServerSettings

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
        job = Job(gen.prompt, gen.options, timeout=gen.timeout)
        engine.submit(job)
        out = Responder(
            isinstance(body, ChatCompletionRequest), settings.model_name, gen.options, gen.include_usage
        )
        try:
            # Streams too wait for the first event before answering, so that an error found by the
            # worker (a prompt longer than the context, a queue timeout) still gets its status code.
            event = await self._wait_for_event(request, job, first=gen.stream)
            if gen.stream and not isinstance(event, Failed):
                return StreamingResponse(
                    self._stream_events(job, event, out),
                    media_type="text/event-stream",
                    headers=SSE_HEADERS,
                    # Runs after Starlette saw the client disconnect, too: a second, certain cancel hook.
                    background=BackgroundTask(engine.cancel, job, "disconnect"),
                )
        except BaseException:  # cancelled by the server (shutdown timeout) or the client left
            engine.cancel(job, "disconnect")
            raise
        if isinstance(event, Failed):
            raise event.error
        assert isinstance(event, Finished)
        return JSONResponse(out.response(event.outcome))

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

    async def _wait_for_event(self, request: Request, job: Job, first: bool) -> Event:
        """The job's first event (``first``) or its final one. Meanwhile, every DISCONNECT_POLL_S (also
        while deltas keep arriving), check the client is still there; if not, cancel the job, answer 499."""
        checked = time.monotonic()
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                if first or not isinstance(event, Delta):
                    return event
            except TimeoutError:
                pass
            if time.monotonic() - checked >= DISCONNECT_POLL_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    self.engine.cancel(job, "disconnect")
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

    async def _stream_events(self, job: Job, event: Event, out: Responder) -> AsyncIterator[bytes]:
        ended = False
        try:
            for chunk in out.opening_chunks():
                yield sse(chunk)
            while True:
                if isinstance(event, Delta):
                    yield sse(out.text_chunk(event.text))
                elif isinstance(event, Finished):
                    ended = True
                    for chunk in out.closing_chunks(event.outcome):
                        yield sse(chunk)
                    break
                else:  # failed after the response started (shutdown, or a bug): an OpenAI error event
                    ended = True
                    yield sse(error_payload(event.error))
                    break
                event = await job.events.get()
            yield sse("[DONE]")
        finally:
            if not ended:  # the client went away (Starlette cancelled or closed this generator)
                self.engine.cancel(job, "disconnect")


def defaults_card(decoder: Decoder, defaults: GenerationOptions) -> dict[str, Any]:
    """What a request that sets no ``marspec`` field gets: the rule, whether it is lossless, k, and for a
    lossy rule the margin and theta it decodes with when greedy and when sampling (they may differ, by
    measurement or by calibration)."""
    lossless = defaults.rule in LOSSLESS_RULES
    card: dict[str, Any] = {"rule": defaults.rule, "lossless": lossless, "k": defaults.k}
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
