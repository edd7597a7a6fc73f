"""Log probabilities as OpenAI's responses show them: each token as text and UTF-8 bytes (made on the
worker thread, which owns the tokenizer) and the two shapes, chat's ``content`` list and completions'
parallel lists."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from marspec.api import TokenLogprob

MAX_CHAT_TOP = 20  # OpenAI's bounds on the alternatives listed per token
MAX_COMPLETION_TOP = 5
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback tokens


@dataclass(frozen=True)
class TokenText:
    """A token as a response shows it: its text, its bytes and its log probability."""

    token: str
    bytes: tuple[int, ...]
    logprob: float

    def to_dict(self) -> dict[str, Any]:
        return {"token": self.token, "logprob": self.logprob, "bytes": list(self.bytes)}


@dataclass(frozen=True)
class TokenEntry:
    """A generated token and the target's most likely tokens there, as text."""

    chosen: TokenText
    top: tuple[TokenText, ...]


def token_entries(tokenizer: Any, logprobs: Sequence[TokenLogprob]) -> tuple[TokenEntry, ...]:
    """``logprobs`` with each token's text and bytes (call on the thread that owns ``tokenizer``)."""

    def text(token_id: int, logprob: float) -> TokenText:
        token, raw = token_text(tokenizer, token_id)
        return TokenText(token, raw, logprob)

    return tuple(
        TokenEntry(text(t.token_id, t.logprob), tuple(text(i, v) for i, v in t.top)) for t in logprobs
    )


def token_text(tokenizer: Any, token_id: int) -> tuple[str, tuple[int, ...]]:
    """One token's text (special tokens as written) and the UTF-8 bytes it stands for. A token holding
    part of a multi-byte character decodes to U+FFFD; its bytes are then read from the vocabulary
    entry (byte-level BPE's alphabet, or SentencePiece's ``<0xNN>``) where it has that form."""
    token = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" in token:
        raw = _piece_bytes(tokenizer.convert_ids_to_tokens(token_id))
        if raw is not None:
            return token, raw
    return token, tuple(token.encode("utf-8"))


def _piece_bytes(piece: str | None) -> tuple[int, ...] | None:
    if not piece:
        return None
    byte = _BYTE_TOKEN.fullmatch(piece)
    if byte:
        return (int(byte.group(1), 16),)
    decoder = _byte_level_decoder()
    if all(c in decoder for c in piece):
        return tuple(decoder[c] for c in piece)
    return None


@cache
def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's) alphabet: each byte written as one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars = {b: chr(b) for b in printable}
    extra = [b for b in range(256) if b not in chars]
    chars.update((b, chr(256 + n)) for n, b in enumerate(extra))
    return {c: b for b, c in chars.items()}


def chat_logprobs(entries: Sequence[TokenEntry]) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs``: ``{"content": [...], "refusal": None}``."""
    content = [{**e.chosen.to_dict(), "top_logprobs": [t.to_dict() for t in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[TokenEntry], offset: int = 0) -> dict[str, Any]:
    """A completion choice's (or chunk's) ``logprobs``; ``text_offset`` counts characters of the
    completion from ``offset`` (the characters sent before this chunk)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.chosen.token)
    return {
        "tokens": [e.chosen.token for e in entries],
        "token_logprobs": [e.chosen.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }
