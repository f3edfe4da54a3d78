"""The OpenAI-compatible HTTP server: ``create_app(engine, config) -> FastAPI``.

Routes (one router each, over one ``ServerState``): POST /v1/completions, POST /v1/chat/completions (JSON or SSE
with ``stream: true``), POST /tokenize, POST /detokenize, and GET /v1/models, /health, /metrics (Prometheus
text), /version. Errors are OpenAI-shaped (see ``dspark.serve.errors``); every route but /health needs the API
key when one is set.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from dspark import __version__
from dspark.engine.engine import Engine
from dspark.serve import disagg
from dspark.serve.config import ServerConfig
from dspark.serve.errors import install_error_handlers
from dspark.serve.inputs import chat_roles
from dspark.serve.middleware import ApiKeyMiddleware, BodyLimitMiddleware, ErrorMiddleware
from dspark.serve.openapi import served_limits
from dspark.serve.routes import admin, chat, completions, tokenize
from dspark.serve.state import ServerState


def create_app(
    engine: Engine, config: ServerConfig | None = None, *, api_key: str | None = None, model_name: str | None = None
) -> FastAPI:
    """``api_key`` / ``model_name`` are shorthands for the ``ServerConfig`` fields (when no config is given)."""
    config = config or ServerConfig(api_key=api_key, served_model_name=model_name)
    state = ServerState(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            state.shutdown()

    app = FastAPI(title="dspark", version=__version__, lifespan=lifespan)
    app.state.dspark = state
    for module in (completions, chat, tokenize, admin, disagg):
        app.include_router(module.router)
    generic = app.openapi

    def openapi() -> dict:  # the request models' schema with the served model's limits (serve/openapi.py)
        if app.openapi_schema is None:
            served_limits(generic(), engine.target.config.vocab_size, engine.max_model_len, chat_roles(engine))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    install_error_handlers(app)
    app.add_middleware(ErrorMiddleware)  # innermost: the first added
    limits = {"max_bytes": config.max_request_bytes, "max_kv_transfer_bytes": config.max_kv_transfer_bytes}
    app.add_middleware(BodyLimitMiddleware, **limits)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    return app
