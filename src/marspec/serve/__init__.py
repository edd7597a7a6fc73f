"""``marspec serve``: an OpenAI-compatible HTTP server with MARS controls (needs ``marspec[serve]``).

``schemas`` (request bodies -> a generation) · ``engine`` (one worker thread owning the Decoder, a bounded
queue, cancellation between decode steps) · ``responses`` (OpenAI bodies and SSE chunks) · ``metrics``
(Prometheus) · ``served_model`` (what the routes do: complete, describe the model, report health) ·
``routes`` (the endpoints) · ``app`` (the FastAPI app assembled: routes, guards, error handlers) ·
``server`` (uvicorn, SIGTERM drain) · ``process`` (run it as a child process) · ``settings`` ·
``errors`` (OpenAI error bodies).
"""

from __future__ import annotations

from marspec.serve.app import create_app
from marspec.serve.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
