"""Turning a user's prompt (text or chat messages) into token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jinja2
import torch
from transformers import PreTrainedTokenizerBase

from marspec.errors import ChatTemplateError, MarspecError

Prompt = str | Sequence[dict[str, Any]]


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
        checked.append({"role": msg["role"], "content": msg["content"]})
    if not any(m["content"].strip() for m in checked):
        raise MarspecError("empty prompt: every chat message's content is blank")
    return checked


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: Prompt, chat: bool, model_name: str
) -> torch.Tensor:
    """Return the prompt's token ids (long[L]).

    With ``chat``, a string becomes one user message and the model's chat template is applied with the
    assistant turn opened; without it the text is tokenized as is.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise MarspecError("empty prompt: give some text to continue")
        messages = [{"role": "user", "content": prompt}] if chat else None
    elif isinstance(prompt, Sequence):
        messages = validate_messages(prompt)
    else:
        raise MarspecError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")

    if messages is None:
        ids = tokenizer(prompt).input_ids
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise MarspecError(
                f"model {model_name!r} has no chat template: pass a plain string prompt with chat=False"
            )
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except jinja2.TemplateError as exc:  # templates raise on what they do not accept
            raise ChatTemplateError(f"the model's chat template refused the messages: {exc}") from None
        # The template already wrote the special tokens; do not let the tokenizer add a second BOS.
        ids = tokenizer(text, add_special_tokens=False).input_ids
    if not ids:
        raise MarspecError("empty prompt: it encodes to no tokens")
    return torch.tensor(ids, dtype=torch.long)
