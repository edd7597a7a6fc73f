"""Thinking spans: where the ``thinking`` guard lets a lossy rule relax.

A reasoning model writes its scratch work between a start and an end marker (``<think>`` and
``</think>`` in the tokenizers that have them) before the answer. The guard relaxes only inside such a
span, where a near-tie costs least, and verifies the answer after it strictly; the markers themselves are
never relaxed (neither a drafted marker nor a draft token in place of the target's marker), so a span
opens and closes only where the target itself puts its marker. Each marker is one token of the target's
vocabulary, read from the tokenizer or given as a string per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from marspec.errors import MarspecError

# The markers a tokenizer is asked for when a request names none (DeepSeek-R1's, Qwen3's, QwQ's).
DEFAULT_MARKERS = ("<think>", "</think>")


@dataclass(frozen=True)
class ThinkingMarkers:
    """The token ids that open and close a thinking span."""

    start: int
    end: int

    def open_after(self, tokens: Sequence[int], is_open: bool = False) -> bool:
        """Whether a span is open after ``tokens`` (host ints), given whether it was open before them."""
        for token in reversed(tokens):
            if token == self.start:
                return True
            if token == self.end:
                return False
        return is_open

    def span(self, draft: torch.Tensor, is_open: bool) -> ThinkingSpan:
        """Where draft positions ``0..K-1`` lie inside a span: the last marker before position ``i``
        (among the committed text, summed up by ``is_open``, and ``draft[:i]``) is a start marker."""
        kind = (draft == self.start).long() - (draft == self.end).long()  # [K]: +1 start, -1 end, 0
        index = torch.arange(1, draft.shape[0] + 1, device=draft.device)
        # The latest marker at or before each position, as 1 + its index (0: none in the draft).
        latest = torch.cummax(torch.where(kind != 0, index, torch.zeros_like(index)), 0).values  # [K]
        before = torch.cat([latest.new_zeros(1), latest])[:-1]  # the latest strictly before position i
        opened = torch.cat([kind.new_full((1,), 1 if is_open else -1), kind])[before]  # [K]
        markers = torch.tensor([self.start, self.end], device=draft.device, dtype=torch.long)
        return ThinkingSpan(inside=opened > 0, markers=markers)


@dataclass(frozen=True)
class ThinkingSpan:
    """One draft block's view of the thinking spans (:meth:`ThinkingMarkers.span`)."""

    inside: torch.Tensor  # bool[K]: draft position i lies inside a span
    markers: torch.Tensor  # long[2]: the start and end marker ids

    def allows(self, tokens: torch.Tensor, top1: torch.Tensor) -> torch.Tensor:
        """Bool ``[K]``: where a relaxed accept of ``tokens`` in place of the target's ``top1`` (each
        ``long[K]``) is let through: inside a span, and neither token a marker."""
        markers = self.markers.to(tokens.device)
        return self.inside & ~torch.isin(tokens.long(), markers) & ~torch.isin(top1.long(), markers)


def check_marker_strings(markers: object) -> tuple[str, str] | None:
    """``markers`` as ``(start, end)``: two different non-empty strings, or None (the tokenizer's own);
    else the one-line error."""
    if markers is None:
        return None
    if (
        isinstance(markers, (list, tuple))
        and len(markers) == 2
        and all(isinstance(m, str) and m for m in markers)
        and markers[0] != markers[1]
    ):
        return (markers[0], markers[1])
    raise MarspecError(
        f"thinking={markers!r} is invalid: give the span's start and end markers as two different "
        "strings, e.g. ('<think>', '</think>'), each one token of the target's vocabulary",
        field="thinking",
    )


def thinking_markers(tokenizer: Any, markers: tuple[str, str] | None) -> ThinkingMarkers:
    """The marker ids of ``markers`` (unset: :data:`DEFAULT_MARKERS`) in ``tokenizer``'s vocabulary; a
    marker that is not one token there is refused in one line."""
    start, end = markers or DEFAULT_MARKERS
    vocab = tokenizer.get_vocab()
    missing = [m for m in (start, end) if m not in vocab]
    if missing:
        given = "the tokenizer's default markers" if markers is None else "the thinking markers"
        raise MarspecError(
            f"{given} {', '.join(repr(m) for m in missing)} are not single tokens of the target's vocabulary "
            "(not a reasoning model's tokenizer?): pass thinking=(START, END), two of its tokens",
            field="thinking",
        )
    return ThinkingMarkers(start=int(vocab[start]), end=int(vocab[end]))
