"""OpenAI-shaped errors, ``{"error": {"message", "type", "param", "code"}}``, and the handlers that produce them.

400 bad input (malformed JSON, wrong types, values out of range, prompts longer than the context), 401 missing or
wrong API key, 404 unknown model or route, 405 a method the path does not serve (with ``Allow``), 413 body over
``--max-request-bytes``, 503 full waiting queue, 500 for a request the engine failed (it keeps serving the others)
or an unexpected error. Every error is answered as a normal response, so the client's keep-alive connection
survives it. ``error_responses`` declares them in /openapi.json (one table, the ``ErrorResponse`` model).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.engine.engine import EngineError
from dspark.sampling_params import SamplingParamsError
from dspark.serve.async_engine import EngineDeadError, QueueFullError, RequestFailedError
from dspark.serve.protocol import DEPLOYMENT_LIMIT_CODES, ErrorInfo, ErrorResponse

logger = logging.getLogger("dspark.serve")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    @property
    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status, headers=headers)


def api_error_of(e: BaseException) -> APIError:
    """The OpenAI error for any exception a route can raise."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(503, str(e), "server_overloaded", None, "queue_full")
    if isinstance(e, SamplingParamsError):
        m = re.match(r"sampling parameter (\w+)=", str(e))
        return APIError(400, str(e), param=m.group(1) if m else None, code="invalid_value")
    if isinstance(e, EngineError):
        return APIError(400, str(e), code="invalid_value")
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), "server_error", None, "request_failed")
    if isinstance(e, EngineDeadError):
        return APIError(500, str(e), "server_error", None, "engine_dead")
    return APIError(500, f"internal error: {e!r}", "server_error")


ERROR_STATUSES: dict[int | str, str] = {
    400: "The request is invalid: malformed JSON, a wrong type, a value out of range, or a limit of the served "
    "model or of the server's flags, whose error codes are: " + ", ".join(sorted(DEPLOYMENT_LIMIT_CODES)) + ".",
    401: "Missing or wrong API key (only when the server was started with --api-key or DSPARK_API_KEY).",
    404: "The model named in the request is not the one this server serves (see GET /v1/models).",
    413: "The request body is larger than --max-request-bytes.",
    500: "The engine failed this request (the server keeps serving the others), or an unexpected error.",
    503: "The waiting queue is full (retry after the Retry-After header's seconds), or the engine loop stopped.",
    "4XX": "Any other client error, as the same error object (405 for a method the path does not serve, with Allow).",
}


def error_responses(*statuses: int | str) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of these statuses, each the OpenAI error object (``ErrorResponse``). A route with
    a body lists "4XX": FastAPI then declares no 422 of its own (validation errors are 400s here)."""
    return {s: {"model": ErrorResponse, "description": ERROR_STATUSES[s]} for s in statuses}


GET_ERRORS = error_responses(401, 500)
BODY_ERRORS = error_responses(400, 401, 404, 413, 500, "4XX")
GENERATION_ERRORS = error_responses(400, 401, 404, 413, 500, 503, "4XX")


async def _known_error(_: Request, e: Exception) -> JSONResponse:
    err = api_error_of(e)
    return err.response({"Retry-After": "1"} if err.status == 503 else None)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def field_path(loc: Sequence[Any]) -> list[str]:
    """A pydantic error location as field names (drops 'body' and union-branch tags like 'list[int]')."""
    return [str(x) for x in loc if x != "body" and not ("[" in str(x) or str(x) in _TYPE_TAGS)]


def validation_error(errs: Sequence[Any]) -> APIError:
    # a value our validators refused says more than the other branches of a union ("should be a valid list")
    errs = sorted(errs, key=lambda err: err.get("type") != "value_error")
    first = errs[0] if errs else {}
    loc = field_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        msg = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        return APIError(400, msg, code="invalid_json")
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "missing", "model_type"):
        msg = "the request body must be a JSON object (with the header Content-Type: application/json)"
        return APIError(400, msg, code="invalid_json")
    details = "; ".join(f"{'.'.join(field_path(err.get('loc', ()))) or 'body'}: {err.get('msg')}" for err in errs[:5])
    return APIError(400, f"invalid request: {details}", param=".".join(loc) or None, code="invalid_value")


async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    return validation_error(e.errors()).response()


async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    code = "request_too_large" if e.status_code == 413 else None
    return APIError(e.status_code, str(e.detail), kind, None, code).response(e.headers)  # 405 keeps its Allow


def install_error_handlers(app: FastAPI) -> None:
    for cls in (APIError, EngineError, SamplingParamsError, EngineDeadError, RequestFailedError):
        app.add_exception_handler(cls, _known_error)
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
