"""``serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated

import typer

from marspec.cli.common import LoadSettings, app, err, load_decoder, user_errors
from marspec.cli.options import (
    ChosenDraftConfidenceOpt,
    ChosenKOpt,
    DeviceOpt,
    DraftOpt,
    DraftQuantOpt,
    DtypeOpt,
    GraphsOpt,
    LookupOpt,
    MarginOpt,
    PrepackOpt,
    TargetOpt,
    TargetQuantOpt,
    ThetaOpt,
    ThreadsOpt,
)
from marspec.defaults import (
    DEFAULT_DRAFT_QUANT,
    DEFAULT_DTYPE,
    DEFAULT_LOOKUP,
    DEFAULT_PREPACK,
    DEFAULT_RULE,
    DEFAULT_TARGET_QUANT,
)
from marspec.errors import MarspecError
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET
from marspec.rules import RuleName, parse_theta, uses_drafter
from marspec.settings import GenerationOptions

if TYPE_CHECKING:
    import socket

API_KEY_ENV = "MARSPEC_API_KEY"
ServeRuleOpt = Annotated[
    str | None,
    typer.Option(
        "--rule",
        help=f"Rule for requests that name none: {' | '.join(RuleName)}. "
        f"Default: {DEFAULT_RULE} (lossless); a request picks its own with marspec.rule.",
        show_default=False,
    ),
]
HostOpt = Annotated[str, typer.Option("--host", help="Address to listen on.")]
PortOpt = Annotated[int, typer.Option("--port", help="Port (0 picks a free one and prints it).")]
MaxTokensOpt = Annotated[
    int, typer.Option("--max-tokens", help="max_tokens of requests that do not give one.")
]
MaxQueueOpt = Annotated[
    int, typer.Option("--max-queue", help="Requests that may wait while --max-batch generate; more get 429.")
]
MaxBatchOpt = Annotated[
    int | None,
    typer.Option(
        "--max-batch",
        help="Requests decoded together (continuous batching). Default: 2 per CPU core (4-8) on the CPU "
        "int8/int4 engines, where they share each forward and each answer equals its solo answer; 1 "
        "elsewhere (more would take turns: exact, no faster).",
        show_default=False,
    ),
]
RequestTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--request-timeout",
        help="Seconds from arrival; a generation then ends with its text so far, a queued request "
        "gets 503. 0 = no limit.",
    ),
]
ShutdownGraceOpt = Annotated[
    float, typer.Option("--shutdown-grace", help="Seconds work may still finish after SIGTERM.")
]
MaxRequestMbOpt = Annotated[
    float,
    typer.Option(
        "--max-request-mb",
        help="Largest request body in MB (2**20 bytes); a larger one gets 413 before it is parsed.",
    ),
]
ServedModelNameOpt = Annotated[
    str | None, typer.Option("--served-model-name", help="The `model` clients send (default: --target).")
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar=API_KEY_ENV,
        help="Require Authorization: Bearer KEY (the OpenAI client's api_key) on every request but "
        "/health; others get 401. The flag wins over the environment variable, which keeps the key out "
        "of the process list.",
        show_default=False,
    ),
]
LogLevelOpt = Annotated[str, typer.Option("--log-level", help="uvicorn log level.")]
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@app.command()
def serve(
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    draft_quant: DraftQuantOpt = DEFAULT_DRAFT_QUANT,
    target_quant: TargetQuantOpt = DEFAULT_TARGET_QUANT,
    draft_confidence: ChosenDraftConfidenceOpt = None,
    lookup: LookupOpt = DEFAULT_LOOKUP,
    prepack: PrepackOpt = DEFAULT_PREPACK,
    device: DeviceOpt = "auto",
    graphs: GraphsOpt = "auto",
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    rule: ServeRuleOpt = None,
    theta: ThetaOpt = None,
    margin: MarginOpt = None,
    k: ChosenKOpt = None,
    max_tokens: MaxTokensOpt = 256,
    max_queue: MaxQueueOpt = 8,
    max_batch: MaxBatchOpt = None,
    request_timeout: RequestTimeoutOpt = 300.0,
    shutdown_grace: ShutdownGraceOpt = 20.0,
    max_request_mb: MaxRequestMbOpt = 4.0,
    served_model_name: ServedModelNameOpt = None,
    api_key: ApiKeyOpt = None,
    dtype: DtypeOpt = DEFAULT_DTYPE,
    threads: ThreadsOpt = None,
    log_level: LogLevelOpt = "info",
) -> None:
    """Serve an OpenAI-compatible HTTP API (chat and text completions, models, health, Prometheus metrics)."""
    with user_errors():
        if log_level not in LOG_LEVELS:
            raise MarspecError(f"unknown --log-level {log_level!r}: choose one of {', '.join(LOG_LEVELS)}")
        defaults = GenerationOptions(
            rule=rule, theta=parse_theta(theta), margin=margin, k=k, max_new_tokens=max_tokens
        )
        if uses_drafter(defaults.rule) and draft == "none":
            raise MarspecError(
                f"--rule {defaults.rule} needs a drafter: give --draft NAME|ngram, or use --rule plain"
            )
        try:
            from marspec.serve.server import bind_socket, run_server
            from marspec.serve.settings import ServerSettings
        except ImportError as exc:
            raise MarspecError(
                f"marspec serve needs the serve extra ({exc.name} is missing): pip install 'marspec[serve]'"
            ) from None
        settings = ServerSettings(
            model_name=served_model_name or target,
            defaults=defaults,
            max_queue=max_queue,
            max_batch=max_batch,
            request_timeout=request_timeout or None,
            shutdown_grace=shutdown_grace,
            max_request_bytes=round(max_request_mb * 2**20) if math.isfinite(max_request_mb) else 0,
            api_key=api_key,
        )
        _check_batching(max_batch, graphs, device, draft)
        sock = bind_socket(host, port)  # fail on a taken port before spending seconds loading models
        try:
            load_settings = LoadSettings(
                draft_quant, draft_confidence, lookup, prepack, device, target_quant, graphs
            )
            decoder = load_decoder(target, draft, dtype, threads, load_settings)
            decoder.settle(settings.defaults)  # theta=auto: refuse to start uncalibrated (greedy)
            err.print(_listening(settings.model_name, host, sock, api_key), highlight=False, soft_wrap=True)
            run_server(decoder, settings, sock, log_level)
        finally:
            sock.close()


def _check_batching(max_batch: int | None, graphs: str, device: str, draft: str) -> None:
    """Refuse, before any model loads, a batch the fixed-shape path (CUDA graphs) cannot decode: one
    drafted by an EAGLE-3 head."""
    if max_batch is None or max_batch <= 1:
        return
    from marspec.backends.fixed import graphs_plan
    from marspec.backends.fixed_batch import HIDDEN_STATES_REFUSAL
    from marspec.devices import resolve_device
    from marspec.models.eagle3 import find_head

    if not graphs_plan(graphs, resolve_device(device))[0]:
        return
    if find_head(draft) is not None:
        raise MarspecError(f"--max-batch {max_batch}: {HIDDEN_STATES_REFUSAL}")


def _listening(model_name: str, host: str, sock: socket.socket, api_key: str | None) -> str:
    """The line that says where the server listens and whether it asks for a key."""
    where = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
    url = f"http://{where}:{sock.getsockname()[1]}"
    access = "API key required" if api_key is not None else "no API key: open to anyone who can connect"
    return f"marspec serve: {model_name} on {url} ({access})"
