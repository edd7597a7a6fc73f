"""GSM8K: the final number of a worked answer, and whether it matches the reference."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from marspec.errors import MarspecError

_NUMBER = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+"
# "#### 1,234.5", "#### $18", "####-3": the format the GSM8K prompt asks for (the last one counts).
_STRICT_RE = re.compile(r"####[ \t]*(-?)[ \t]*\$?[ \t]*(" + _NUMBER + ")")
# Any number; a minus sign counts only when it does not follow a word, digit or ")" ("2019-2020").
_ANY_NUMBER_RE = re.compile(r"((?<![\w.)])-)?\$?(" + _NUMBER + ")")


def normalize_number(text: str) -> str:
    """Canonical spelling of a number: no commas, '$' or trailing '.'; ``"18.0"`` -> ``"18"``.

    Text that is not a number comes back stripped of those characters but otherwise unchanged.
    """
    t = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        d = Decimal(t)
    except InvalidOperation:
        return t
    if not d.is_finite():
        return t
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_gsm8k_answer(text: str) -> str | None:
    """The model's final answer, normalised (see :func:`normalize_number`), or ``None`` if it has none.

    The last ``#### <number>`` wins; without one, the last number anywhere in the text.
    """
    strict = _STRICT_RE.findall(text)
    if strict:
        sign, number = strict[-1]
        return normalize_number(sign + number)
    loose = _ANY_NUMBER_RE.findall(text)
    if loose:
        sign, number = loose[-1]
        return normalize_number(sign + number)
    return None


def grade_gsm8k(text: str, reference: str) -> bool:
    """Whether the answer extracted from ``text`` equals the reference number."""
    if reference is None or not normalize_number(str(reference)):
        raise MarspecError("grade_gsm8k needs the reference answer: pass the question's .reference")
    return extract_gsm8k_answer(text) == normalize_number(str(reference))
