"""Incremental detokenization: text deltas for streaming and stop strings without re-decoding the whole
output at every step."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes only a short window: the tokens since the last emitted boundary plus the new ones. A delta
    is held back while it ends in U+FFFD, the mark of a multi-byte character split across tokens; at the
    end of a generation :meth:`flush` gives what is still held back, so that the deltas always add up to
    the decoding of every token pushed (a text may end inside a character: it then ends in U+FFFD, as
    ``tokenizer.decode`` of its tokens does).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens before this index are already in self.text

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text they completed (may be empty)."""
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The text held back (a character the last tokens did not complete, decoded as U+FFFD); after
        it, ``self.text`` is the decoding of every token pushed."""
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix :], skip_special_tokens=True)
        delta = after[len(before) :]
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta
