"""Request bodies of the OpenAI-compatible endpoints, and their translation into a generation.

Pydantic checks shapes and types; the values are checked by the library's own
:class:`~marspec.api.GenerationOptions`, so the rules for theta, k, temperature, ... live in one place
and a :class:`~marspec.errors.MarspecError` from them becomes a 400 naming the offending parameter. What
the server cannot do (nucleus sampling, penalties, tools, ...) is refused with a 400
that says so, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from marspec.api import GenerationOptions
from marspec.errors import MarspecError
from marspec.prompting import Prompt, check_text
from marspec.rules import LOSSLESS_RULES, uses_drafter
from marspec.serve.errors import ApiError
from marspec.serve.logprobs import MAX_CHAT_TOP, MAX_COMPLETION_TOP
from marspec.serve.settings import ServerSettings

INT64 = (-(2**63), 2**63 - 1)  # OpenAI's seed range; torch would fail on larger seeds with a 500
SHOWN_CHARS = 80  # the most of a client's value an error message quotes
MAX_TEMPERATURE = 2.0  # OpenAI's upper bound (the library itself accepts any temperature >= 0)
# The most choices (n) one request may ask for: each is a generation of its own, queued as one.
MAX_CHOICES = 8
# The shortest marspec.timeout a request may ask for: below it no model answers in time (one decode step
# of the smallest model takes milliseconds, a request's way through the server about one), so a shorter
# one is a mistake to report (400), not an overload (503).
MIN_TIMEOUT_S = 0.1


class _Body(BaseModel):
    # Strict: "5" is not a number and 1 is not true. Unknown fields are refused (the handler reports
    # them as unsupported parameters) instead of being silently dropped.
    model_config = ConfigDict(extra="forbid", strict=True)


class MarspecParams(_Body):
    """The ``"marspec"`` object of a request body: per-request verification controls."""

    rule: str | None = None
    theta: float | Literal["auto"] | None = None  # "auto": the pair's calibrated setting
    margin: str | None = None
    k: int | None = None
    timeout: float | None = None  # seconds; may only shorten the server's --request-timeout


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    # "developer" is OpenAI's newer name for "system"; templates of local models only know the latter.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_dict(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class _GenerationBody(_Body):
    """Fields both endpoints share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    marspec: MarspecParams | None = None
    user: str | None = None  # an end-user id for the caller's own records; it does not affect generation
    n: int | None = None  # choices, each generated on its own (choice i with seed + i when seeded)
    # Accepted only at their neutral value (clients often send those explicitly); see UNSUPPORTED.
    top_p: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None


class ChatCompletionRequest(_GenerationBody):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None  # alternatives listed per token, with logprobs=true
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None


class CompletionRequest(_GenerationBody):
    """``POST /v1/completions``."""

    prompt: str | list[str]
    logprobs: int | None = None  # alternatives listed per token (0: the chosen token's only)
    echo: Any = None
    best_of: Any = None
    suffix: Any = None


# Parameters marspec does not implement, with the values that mean "not used" and why it cannot do more.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((1,), "returns every choice it generates (n) and picks none"),
    "top_p": ((1,), "samples from the full distribution (temperature only)"),
    "presence_penalty": ((0,), "applies no penalties"),
    "frequency_penalty": ((0,), "applies no penalties"),
    "logit_bias": (({},), "does not bias logits"),
    "echo": ((False,), "does not echo prompts"),
    "suffix": (("",), "does not insert text"),
    "tools": (([],), "does not call tools"),
    "tool_choice": (("none",), "does not call tools"),
    "response_format": (({"type": "text"},), "produces plain text only"),
}


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request: what to generate, how, and how to deliver it."""

    prompt: Prompt
    options: GenerationOptions
    stream: bool
    include_usage: bool
    timeout: float | None  # seconds from arrival, None = no limit
    n: int = 1  # choices
    max_param: str | None = None  # the parameter that set options.max_new_tokens (None: the default)


def parse_request(
    body: ChatCompletionRequest | CompletionRequest,
    settings: ServerSettings,
    *,
    context_length: int,
    has_drafter: bool,
) -> GenerationRequest:
    """Check a parsed body against the server's model, limits and features; raise ApiError (400, or
    404 for an unknown model) or return the generation to run."""
    model_name = settings.model_name
    if body.model != model_name:
        raise ApiError(
            404,
            f"the model {body.model!r} does not exist: this server serves {model_name!r}",
            param="model",
            code="model_not_found",
        )
    _refuse_unsupported(body)
    if isinstance(body, ChatCompletionRequest):
        prompt: Prompt = [m.as_dict() for m in body.messages]
        chat = None  # messages always go through the chat template
        max_tokens, max_param = _max_tokens(body)
    else:
        prompt = _single_prompt(body.prompt)
        chat = False  # a completion continues the raw text
        max_tokens, max_param = body.max_tokens, "max_tokens"
    _check_unicode(prompt, body.stop)
    _check_api_ranges(body, max_tokens, max_param, context_length)

    extra = body.marspec or MarspecParams()
    tuning = [f"marspec.{f}" for f in ("theta", "margin") if getattr(extra, f) is not None]
    if tuning and extra.rule is None and settings.defaults.rule in LOSSLESS_RULES:
        # The server's lossless rule would ignore them: a silent no-op is worse than a clear 400.
        raise ApiError(
            400,
            f"{' and '.join(tuning)} tune a lossy rule, and this server decodes requests that name no rule "
            f"with {settings.defaults.rule!r}, which never relaxes: add marspec.rule, e.g. 'mars'",
            param="marspec.rule",
        )
    overrides = [  # (GenerationOptions field, value, request parameter)
        ("max_new_tokens", max_tokens, max_param),
        ("temperature", body.temperature, "temperature"),
        ("seed", body.seed, "seed"),
        ("stop", body.stop, "stop"),
        _logprobs(body),
        *((f, getattr(extra, f), f"marspec.{f}") for f in ("rule", "theta", "margin", "k")),
    ]
    options = _options(settings.defaults, [(f, v, p) for f, v, p in overrides if v is not None], chat)
    if uses_drafter(options.rule) and not has_drafter:
        raise ApiError(
            400,
            f"rule {options.rule!r} needs a drafter and this server runs without one (--draft none): "
            "use marspec.rule='plain'",
            param="marspec.rule",
        )
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    timeout = _timeout(extra, settings)
    return GenerationRequest(
        prompt,
        options,
        body.stream,
        include_usage,
        timeout,
        _choices(body),
        max_param if max_tokens is not None else None,
    )


def _choices(body: ChatCompletionRequest | CompletionRequest) -> int:
    if body.n is None:
        return 1
    if not 1 <= body.n <= MAX_CHOICES:
        raise ApiError(400, f"n must be an integer in [1, {MAX_CHOICES}], got {body.n}", param="n")
    return body.n


def _logprobs(body: ChatCompletionRequest | CompletionRequest) -> tuple[str, int | None, str]:
    """The ``logprobs`` option a request asks for (None: off), as an override ``(field, value, param)``:
    chat's ``logprobs`` (true/false) and ``top_logprobs`` (0-20, with logprobs), completions'
    ``logprobs`` (0-5 alternatives)."""
    if isinstance(body, CompletionRequest):
        top, param, bound = body.logprobs, "logprobs", MAX_COMPLETION_TOP
    else:
        top, param, bound = body.top_logprobs, "top_logprobs", MAX_CHAT_TOP
    if top is not None and not 0 <= top <= bound:
        raise ApiError(400, f"{param} must be an integer in [0, {bound}], got {top}", param=param)
    if isinstance(body, CompletionRequest):
        return "logprobs", top, param
    if top and not body.logprobs:
        raise ApiError(
            400, "top_logprobs lists alternatives of logprobs: set logprobs=true too", param="top_logprobs"
        )
    return "logprobs", (top or 0) if body.logprobs else None, "logprobs"


def _check_unicode(prompt: Prompt, stop: str | list[str] | None) -> None:
    """A named 400 (code ``invalid_unicode``) for a prompt or stop string holding a lone UTF-16
    surrogate, which JSON lets through (``"\\ud800"``, or the bytes ED A0 80) and no tokenizer can read
    (nor can any generated text contain it). Refused, not replaced: the client's text is not silently
    changed."""
    if isinstance(prompt, str):
        texts = [("prompt", prompt)]
    else:
        texts = [(f"messages.{i}.content", m["content"]) for i, m in enumerate(prompt)]
    if isinstance(stop, str):
        texts.append(("stop", stop))
    elif stop is not None:
        texts += [(f"stop.{i}", s) for i, s in enumerate(stop)]
    for param, text in texts:
        try:
            check_text(text, param)
        except MarspecError as exc:
            raise ApiError(400, str(exc), param=param, code="invalid_unicode") from None


def _timeout(extra: MarspecParams, settings: ServerSettings) -> float | None:
    limit = settings.request_timeout
    if extra.timeout is None:
        return limit
    within = math.isfinite(extra.timeout) and extra.timeout >= MIN_TIMEOUT_S
    if not (within and (limit is None or extra.timeout <= limit)):
        bound = "" if limit is None else f" and at most the server's limit of {limit:g}"
        raise ApiError(
            400,
            f"marspec.timeout must be a number of seconds >= {MIN_TIMEOUT_S:g}{bound}, got {extra.timeout}",
            param="marspec.timeout",
        )
    return extra.timeout


def _refuse_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    for name, (neutral, why) in UNSUPPORTED.items():
        value = getattr(body, name, None)
        if value is not None and not _is_neutral(value, neutral):
            raise ApiError(
                400,
                f"{name}={_shown(value)} is not supported: marspec serve {why}; leave it out",
                param=name,
                code="unsupported_parameter",
            )
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")


def _check_api_ranges(
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int | None,
    max_param: str,
    context_length: int,
) -> None:
    """The limits of the OpenAI API and of the model, on top of the library's own (checked later)."""
    if max_tokens is not None and context_length and max_tokens > context_length:
        raise ApiError(
            400,
            f"{max_param} must be at most the model's context length ({context_length}), got {max_tokens}",
            param=max_param,
        )
    if body.temperature is not None and body.temperature > MAX_TEMPERATURE:
        raise ApiError(
            400,
            f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {body.temperature}",
            param="temperature",
        )
    if body.seed is not None and not INT64[0] <= body.seed <= INT64[1]:
        raise ApiError(400, f"seed must be a 64-bit signed integer, got {body.seed}", param="seed")


def _shown(value: Any) -> str:
    """A client's value as an error message quotes it: its repr, cut to SHOWN_CHARS (a body may be
    megabytes)."""
    text = _SHORT_REPR.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


_SHORT_REPR = reprlib.Repr()  # no deeper than 6 levels, no more than 6 items each
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = SHOWN_CHARS


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    if isinstance(value, bool):  # True == 1 in Python, so n=true would pass as n=1; only false means "off"
        return value is False
    return value in neutral


def _max_tokens(body: ChatCompletionRequest) -> tuple[int | None, str]:
    both = body.max_tokens is not None and body.max_completion_tokens is not None
    if both and body.max_tokens != body.max_completion_tokens:
        raise ApiError(
            400,
            "max_tokens and max_completion_tokens disagree: give one of them",
            param="max_completion_tokens",
        )
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def _single_prompt(prompt: str | list[str]) -> str:
    if isinstance(prompt, str):
        return prompt
    if len(prompt) != 1:
        raise ApiError(
            400,
            f"prompt lists {len(prompt)} prompts: marspec serve takes one prompt per request",
            param="prompt",
            code="unsupported_parameter",
        )
    return prompt[0]


def _options(
    defaults: GenerationOptions, overrides: list[tuple[str, Any, str]], chat: bool | None
) -> GenerationOptions:
    """The server defaults with the request's values; on a bad value, a 400 naming its parameter."""
    try:
        return dataclasses.replace(defaults, chat=chat, **{f: v for f, v, _ in overrides})
    except MarspecError as exc:
        # The error names its option when it knows it (a rival's parameter is only wrong for that
        # rule); otherwise find the culprit by trying each value alone on top of the (valid) defaults.
        named = [p for f, _, p in overrides if f == exc.field]
        param = named[0] if named else next((p for f, v, p in overrides if not _valid(defaults, f, v)), None)
        raise ApiError(400, f"invalid {param}: {exc}" if param else str(exc), param=param) from None


def _valid(defaults: GenerationOptions, name: str, value: Any) -> bool:
    try:
        dataclasses.replace(defaults, **{name: value})
    except MarspecError:
        return False
    return True
