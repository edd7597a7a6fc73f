"""Turning a user's prompt (text or chat messages) into token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jinja2
import torch
from transformers import PreTrainedTokenizerBase

from marspec.errors import ChatTemplateError, MarspecError

Prompt = str | Sequence[dict[str, Any]]


def check_text(text: str, what: str) -> None:
    """Refuse text that is not Unicode a tokenizer can read: a lone UTF-16 surrogate (U+D800-U+DFFF),
    which JSON's ``"\\ud800"`` escape or the bytes ED A0 80 produce, has no UTF-8 form, so tokenizing or
    measuring it fails deep inside a library. ``what`` names the text in the message (e.g. ``prompt``)."""
    try:
        text.encode("utf-8")  # in C: fast on megabytes; surrogates are the only text it cannot encode
    except UnicodeEncodeError as exc:
        raise MarspecError(
            f"{what} contains a lone UTF-16 surrogate (U+{ord(text[exc.start]):04X} at character "
            f"{exc.start}), which is not Unicode text: send valid UTF-8 (in JSON, a character beyond "
            "U+FFFF is a surrogate pair such as \\ud83d\\ude00)"
        ) from None


def validate_messages(messages: Sequence[Any]) -> list[dict[str, str]]:
    """Check chat messages are ``[{"role": str, "content": str}, ...]`` with some non-blank content."""
    if not messages:
        raise MarspecError("empty prompt: pass a non-empty string or a non-empty list of chat messages")
    checked = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise MarspecError(
                f"chat message {i} is malformed: each message must be a dict with a 'role' string and a "
                "'content' string"
            )
        if not isinstance(msg.get("content"), str):
            raise MarspecError(f"chat message {i} has no 'content' string")
        check_text(msg["content"], f"chat message {i}'s content")
        checked.append({"role": msg["role"], "content": msg["content"]})
    if not any(m["content"].strip() for m in checked):
        raise MarspecError("empty prompt: every chat message's content is blank")
    return checked


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: Prompt, chat: bool, model_name: str
) -> tuple[str, bool]:
    """Return the text to tokenize and whether the tokenizer should add its special tokens to it.

    With ``chat``, a string becomes one user message and the model's chat template is applied with the
    assistant turn opened; without it the text is used as is.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise MarspecError("empty prompt: give some text to continue")
        check_text(prompt, "the prompt")
        if not chat:
            return prompt, True
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, Sequence):
        messages = validate_messages(prompt)
    else:
        raise MarspecError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
    if not getattr(tokenizer, "chat_template", None):
        raise MarspecError(
            f"model {model_name!r} has no chat template: pass a plain string prompt with chat=False"
        )
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except jinja2.TemplateError as exc:  # templates raise on what they do not accept
        raise ChatTemplateError(f"the model's chat template refused the messages: {exc}") from None
    # The template already wrote the special tokens; do not let the tokenizer add a second BOS.
    return text, False


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: Prompt, chat: bool, model_name: str
) -> torch.Tensor:
    """Return the prompt's token ids (long[L]); see :func:`render_prompt` for ``chat``."""
    text, add_special_tokens = render_prompt(tokenizer, prompt, chat, model_name)
    ids = tokenizer(text, add_special_tokens=add_special_tokens).input_ids
    if not ids:
        raise MarspecError("empty prompt: it encodes to no tokens")
    return torch.tensor(ids, dtype=torch.long)


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most UTF-8 bytes any single token of the vocabulary (special tokens included) stands for.

    A text of B bytes therefore needs at least ceil(B / this) tokens, which bounds a prompt's length
    without tokenizing it. A token that is a fragment of a multi-byte character decodes to U+FFFD (3
    bytes), which can only overstate the maximum: the bound stays a lower bound.
    """
    pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)
    return max(1, *(len(piece.encode("utf-8")) for piece in pieces))


def fewest_tokens(text: str, bytes_per_token: int) -> int:
    """A lower bound on the number of tokens ``text`` encodes to (``bytes_per_token`` from
    :func:`longest_token_bytes`)."""
    return -(-len(text.encode("utf-8")) // bytes_per_token)
