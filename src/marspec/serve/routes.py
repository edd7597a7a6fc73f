"""The server's routes: OpenAI's completions and models endpoints, health and metrics. Each reads the
app's :class:`~marspec.serve.served_model.ServedModel` (``app.state.served``, set by
:func:`marspec.serve.app.create_app`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from marspec.serve.errors import ApiError
from marspec.serve.metrics import CONTENT_TYPE
from marspec.serve.schemas import ChatCompletionRequest, CompletionRequest
from marspec.serve.served_model import ServedModel

router = APIRouter()


def served(request: Request) -> ServedModel:
    """The model the app that received ``request`` serves."""
    return request.app.state.served


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI chat completions; extra body field ``marspec``: {rule, theta, margin, k}."""
    return await served(request).complete(request, body)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    """OpenAI (legacy) text completions: the prompt is continued as raw text, no chat template."""
    return await served(request).complete(request, body)


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [served(request).model_card()]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request) -> dict[str, Any]:
    this = served(request)
    if model != this.settings.model_name:
        raise ApiError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")
    return this.model_card()


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> JSONResponse:
    """200 while requests are accepted; 503 while draining for shutdown or if the worker died. HEAD
    answers the same status without the body (probes that only read the status send it)."""
    return served(request).health()


@router.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    return Response(served(request).metrics.render(), media_type=CONTENT_TYPE)
