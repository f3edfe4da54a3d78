"""GET /v1/models, /health, /version and /metrics (Prometheus text, vLLM names)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from dspark import __version__
from dspark.serve.errors import APIError
from dspark.serve.metrics import CONTENT_TYPE
from dspark.serve.protocol import ModelCard, ModelList
from dspark.serve.state import State

router = APIRouter()


@router.get("/v1/models")
async def models(state: State) -> ModelList:
    root = state.engine.model_dir
    card = ModelCard(id=state.model_name, root=str(root) if root else None, max_model_len=state.engine.max_model_len)
    return ModelList(data=[card])


@router.get("/health")
async def health(state: State) -> Response:
    if not state.async_engine.alive:
        return APIError(503, "the engine loop stopped after an error", "server_error", None, "engine_dead").response()
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict:
    return {"version": __version__}


@router.get("/metrics")
def metrics(state: State) -> Response:  # sync: runs in the threadpool, may wait for the engine lock
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
