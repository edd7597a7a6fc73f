"""What kind of text a token is, decided from its text alone, and the per-vocabulary table of it.

One classification serves the audit page (:mod:`marspec.eval.audit`, which shows a coarser view of it),
the analysis of which relaxed tokens break answers (benchmarks/relaxed_token_classes.py) and the
``class`` guard (:mod:`marspec.verify.relax`), which relaxes only draft tokens of the classes that analysis
found harmless. The guard needs a class for every token id at every step, so the table is computed once
per tokenizer (:func:`relaxable_table`) and kept for as long as the tokenizer lives.

A token's class is read from its text without context, so an alphabetic code name (``result``,
``range``) is a ``word`` like a prose word; ``identifier`` is kept for code-shaped names (with ``_``,
an inner capital or a digit).
"""

from __future__ import annotations

import keyword
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from marspec.errors import MarspecError

# Finest first; every token falls in exactly one.
CLASSES: tuple[str, ...] = (
    "whitespace",  # spaces and newlines only
    "number",  # digits, with at most one decimal point
    "keyword",  # a Python keyword (if, for, while, return, not, ...), with its surrounding space
    "identifier",  # a code-shaped name: with "_", an inner capital or a digit
    "word",  # alphabetic: a prose word, or a code name the text alone cannot tell from one
    "bracket",  # punctuation that opens or closes: ( ) [ ] { }, alone or with other punctuation
    "operator",  # + - * / % = < > ! & | ^ ~ @ and their combinations (==, <=, +=, **)
    "punctuation",  # any other non-alphanumeric text: . , : ; quotes, backslashes, ...
)
_BRACKETS = frozenset("()[]{}")
_OPERATORS = frozenset("+-*/%=<>!&|^~@")
# The audit page's coarser view (its five kinds predate the finer classes).
AUDIT_KIND = {
    "whitespace": "whitespace",
    "number": "number",
    "keyword": "identifier",
    "identifier": "identifier",
    "word": "word",
    "bracket": "punctuation",
    "operator": "punctuation",
    "punctuation": "punctuation",
}


def token_class(piece: str) -> str:
    """The class (one of :data:`CLASSES`) of a token's text ``piece``."""
    text = piece.strip()
    if not text:
        return "whitespace"
    if text.replace(".", "", 1).isdigit():
        return "number"
    if not any(ch.isalnum() for ch in text):
        if any(ch in _BRACKETS for ch in text):
            return "bracket"
        return "operator" if all(ch in _OPERATORS for ch in text) else "punctuation"
    word = text.strip("()[]{}.,:;\"'`")
    if keyword.iskeyword(word):
        return "keyword"
    inner_capital = any(ch.isupper() for ch in word[1:])
    if "_" in word or inner_capital or any(ch.isdigit() for ch in word):
        return "identifier"
    return "word"


def check_classes(classes: Iterable[str]) -> frozenset[str]:
    """``classes`` as a frozenset, or a MarspecError naming an unknown class and the known ones."""
    chosen = frozenset(classes)
    unknown = sorted(chosen - set(CLASSES))
    if unknown:
        raise MarspecError(f"unknown token class(es) {', '.join(unknown)}; use: {', '.join(CLASSES)}")
    if not chosen:
        raise MarspecError(f"no token class given; use some of: {', '.join(CLASSES)}")
    return chosen


# tokenizer -> (vocab_size, class index per token id). Weak keys: a table lives as long as its tokenizer.
_TABLES: weakref.WeakKeyDictionary[Any, tuple[int, torch.Tensor]] = weakref.WeakKeyDictionary()


def class_table(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """``long[vocab_size]``: each token id's class, as an index into :data:`CLASSES`, computed once per
    tokenizer. Ids past the tokenizer's vocabulary (LM heads are often padded) and special tokens decode
    to no text and count as whitespace."""
    cached = _TABLES.get(tokenizer)
    if cached is not None and cached[0] == vocab_size:
        return cached[1]
    known = min(vocab_size, len(tokenizer))
    pieces = tokenizer.batch_decode([[i] for i in range(known)], skip_special_tokens=True)
    index = {name: i for i, name in enumerate(CLASSES)}
    table = torch.full((vocab_size,), index["whitespace"], dtype=torch.long)
    table[:known] = torch.tensor([index[token_class(p)] for p in pieces], dtype=torch.long)
    _TABLES[tokenizer] = (vocab_size, table)
    return table


def relaxable_table(tokenizer: Any, vocab_size: int, classes: Iterable[str]) -> torch.Tensor:
    """``bool[vocab_size]``: True for the token ids whose class is one of ``classes``."""
    chosen = check_classes(classes)
    wanted = torch.tensor([name in chosen for name in CLASSES])
    return wanted[class_table(tokenizer, vocab_size)]
