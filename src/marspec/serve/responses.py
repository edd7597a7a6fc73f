"""OpenAI response bodies and server-sent-event chunks for chat and text completions."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from marspec.api import GenerationOptions
from marspec.serve.engine import Outcome


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: ...`` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def usage(outcome: Outcome) -> dict[str, Any]:
    # cached_tokens: prompt tokens the previous request had cached (OpenAI's name for prefix reuse).
    cached = int((outcome.stats or {}).get("reused_tokens", 0))
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass
class Responder:
    """Builds one request's response (or its stream of chunks) in the shape of its endpoint.

    Every response and final chunk carries a ``"marspec"`` object: the verification settings used, the
    acceptance statistics (``GenerationStats.to_dict()``: tau, drafted, accepted_exact, accepted_relaxed,
    rejected, timings, ...), ``relaxed_positions`` (indices of completion tokens accepted by relaxation),
    ``timed_out`` and ``queue_s``.
    """

    chat: bool
    model: str
    options: GenerationOptions
    include_usage: bool = False
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + self.id

    def marspec(self, outcome: Outcome) -> dict[str, Any]:
        o = self.options
        out: dict[str, Any] = {"rule": o.rule, "theta": o.theta, "margin": o.margin, "k": o.k}
        out.update(outcome.stats or {})
        out.update(
            relaxed_positions=outcome.relaxed_positions,
            timed_out=outcome.timed_out,
            queue_s=round(outcome.queue_s, 6),
        )
        return out

    def response(self, outcome: Outcome) -> dict[str, Any]:
        """The body of a non-streaming response."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": outcome.text}}
        else:
            choice = {"index": 0, "text": outcome.text}
        choice.update(logprobs=None, finish_reason=outcome.finish_reason)
        return {
            **self._envelope("chat.completion" if self.chat else "text_completion"),
            "choices": [choice],
            "usage": usage(outcome),
            "marspec": self.marspec(outcome),
        }

    def opening_chunks(self) -> list[dict[str, Any]]:
        """Chunks sent before any text (chat streams announce the assistant role first, as OpenAI's do)."""
        return [self._chunk("", role=True)] if self.chat else []

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk(text)

    def closing_chunks(self, outcome: Outcome) -> list[dict[str, Any]]:
        """The chunk with finish_reason and the marspec statistics; then, if asked, the usage chunk."""
        last = self._chunk(None, finish_reason=outcome.finish_reason)
        last["marspec"] = self.marspec(outcome)
        chunks = [last]
        if self.include_usage:
            chunks.append({**self._chunk_envelope(), "choices": [], "usage": usage(outcome)})
        return chunks

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk_envelope(self) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion")

    def _chunk(
        self, text: str | None, role: bool = False, finish_reason: str | None = None
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=finish_reason)
        chunk = {**self._chunk_envelope(), "choices": [choice]}
        if self.include_usage:  # OpenAI sends usage: null on every chunk but the last when usage is asked for
            chunk["usage"] = None
        return chunk
