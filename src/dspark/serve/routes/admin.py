"""GET /v1/models, /health, /version and /metrics (Prometheus text, vLLM names)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from dspark import __version__
from dspark.serve.errors import GET_ERRORS, APIError, error_responses
from dspark.serve.metrics import CONTENT_TYPE
from dspark.serve.protocol import ModelCard, ModelList, VersionResponse
from dspark.serve.state import State

router = APIRouter()


@router.get("/v1/models", responses=GET_ERRORS)
async def models(state: State) -> ModelList:
    root = state.engine.model_dir
    card = ModelCard(id=state.model_name, root=str(root) if root else None, max_model_len=state.engine.max_model_len)
    return ModelList(data=[card])


# response_class=Response: FastAPI declares no JSON body for 200 (these answer none), and the error responses
# keep their application/json
@router.get(
    "/health",
    response_class=Response,
    responses={200: {"description": "The engine loop is running (an empty body, as vLLM's)."}}
    | error_responses(500, 503),
)
async def health(state: State) -> Response:
    if not state.async_engine.alive:
        return APIError(503, "the engine loop stopped after an error", "server_error", None, "engine_dead").response()
    return Response(status_code=200)


@router.get("/version", responses=GET_ERRORS)
async def version() -> VersionResponse:
    return VersionResponse(version=__version__)


PROMETHEUS_TEXT = {
    "description": "The metrics in Prometheus' text exposition format.",
    "content": {CONTENT_TYPE: {"schema": {"type": "string"}}},
}


@router.get("/metrics", response_class=Response, responses={200: PROMETHEUS_TEXT} | GET_ERRORS)
def metrics(state: State) -> Response:  # sync: runs in the threadpool, may wait for the engine lock
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
