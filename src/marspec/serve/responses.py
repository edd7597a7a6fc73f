"""OpenAI response bodies and server-sent-event chunks for chat and text completions."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from marspec.api import GenerationOptions
from marspec.serve.engine import Outcome
from marspec.serve.logprobs import TokenEntry, chat_logprobs, completion_logprobs


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: ...`` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def usage(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Usage of a request's choices: the prompt once, the completions summed."""
    # cached_tokens: prompt tokens the previous request had cached (OpenAI's name for prefix reuse).
    cached = int((outcomes[0].stats or {}).get("reused_tokens", 0))
    prompt_tokens = outcomes[0].prompt_tokens
    completion_tokens = sum(o.completion_tokens for o in outcomes)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass
class Responder:
    """Builds one request's response (or its stream of chunks) in the shape of its endpoint.

    Every response and each choice's final chunk carries a ``"marspec"`` object: the verification
    settings used, the acceptance statistics (``GenerationStats.to_dict()``: tau, drafted,
    accepted_exact, accepted_relaxed, rejected, timings, ...), ``relaxed_positions`` (indices of
    completion tokens accepted by relaxation), ``timed_out`` and ``queue_s``; a response of several
    choices lists those per choice under ``"choices"``, after the settings.
    """

    chat: bool
    model: str
    options: GenerationOptions
    include_usage: bool = False
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    # Characters of each choice's completion its chunks' tokens spanned so far (completions' text_offset).
    _offsets: dict[int, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + self.id

    def marspec(self, outcome: Outcome, settings: bool = True) -> dict[str, Any]:
        o = self.options
        out: dict[str, Any] = (
            {"rule": o.rule, "theta": o.theta, "margin": o.margin, "k": o.k} if settings else {}
        )
        out.update(outcome.stats or {})
        out.update(
            relaxed_positions=outcome.relaxed_positions,
            timed_out=outcome.timed_out,
            queue_s=round(outcome.queue_s, 6),
        )
        return out

    def response(self, outcomes: Sequence[Outcome]) -> dict[str, Any]:
        """The body of a non-streaming response: one choice per outcome, in order."""
        choices = []
        for index, outcome in enumerate(outcomes):
            if self.chat:
                choice: dict[str, Any] = {
                    "index": index,
                    "message": {"role": "assistant", "content": outcome.text},
                }
            else:
                choice = {"index": index, "text": outcome.text}
            choice.update(
                logprobs=self._logprobs(outcome.logprobs or (), index), finish_reason=outcome.finish_reason
            )
            choices.append(choice)
        if len(outcomes) == 1:
            marspec = self.marspec(outcomes[0])
        else:
            o = self.options
            marspec = {"rule": o.rule, "theta": o.theta, "margin": o.margin, "k": o.k}
            marspec["choices"] = [self.marspec(outcome, settings=False) for outcome in outcomes]
        return {
            **self._envelope("chat.completion" if self.chat else "text_completion"),
            "choices": choices,
            "usage": usage(outcomes),
            "marspec": marspec,
        }

    def opening_chunks(self, n: int = 1) -> list[dict[str, Any]]:
        """Chunks sent before any text (chat streams announce the assistant role first, for each choice,
        as OpenAI's do)."""
        return [self._chunk(index, "", role=True) for index in range(n)] if self.chat else []

    def text_chunk(self, index: int, text: str, logprobs: Sequence[TokenEntry] = ()) -> dict[str, Any]:
        """Choice ``index``'s new text and the log probabilities of the tokens decoded with it."""
        return self._chunk(index, text, logprobs=logprobs)

    def closing_chunk(
        self, index: int, outcome: Outcome, logprobs: Sequence[TokenEntry] = ()
    ) -> dict[str, Any]:
        """Choice ``index``'s last chunk: its finish_reason, its marspec statistics, and the log
        probabilities of tokens no text chunk carried (a stop string's, a held-back character's)."""
        last = self._chunk(index, None, finish_reason=outcome.finish_reason, logprobs=logprobs)
        last["marspec"] = self.marspec(outcome)
        return last

    def usage_chunk(self, outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
        """The usage chunk after every choice ended, if asked for."""
        if not self.include_usage:
            return []
        return [{**self._chunk_envelope(), "choices": [], "usage": usage(outcomes)}]

    def _logprobs(self, entries: Sequence[TokenEntry], index: int) -> dict[str, Any] | None:
        """A choice's ``logprobs`` field: None unless the request asked for them."""
        if self.options.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(entries)
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + sum(len(e.chosen.token) for e in entries)
        return completion_logprobs(entries, offset)

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk_envelope(self) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion")

    def _chunk(
        self,
        index: int,
        text: str | None,
        role: bool = False,
        finish_reason: str | None = None,
        logprobs: Sequence[TokenEntry] = (),
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice.update(
            logprobs=self._logprobs(logprobs, index) if logprobs else None, finish_reason=finish_reason
        )
        chunk = {**self._chunk_envelope(), "choices": [choice]}
        if self.include_usage:  # OpenAI sends usage: null on every chunk but the last when usage is asked for
            chunk["usage"] = None
        return chunk
