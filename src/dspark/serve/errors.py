"""OpenAI-shaped errors, ``{"error": {"message", "type", "param", "code"}}``, and the handlers that produce them.

400 bad input (malformed JSON, wrong types, values out of range, prompts longer than the context), 401 missing or
wrong API key, 404 unknown model or route, 413 body over ``--max-request-bytes``, 503 full waiting queue, 500 for a
request the engine failed (it keeps serving the others) or an unexpected error. Every error is answered as a normal
response, so the client's keep-alive connection survives it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.engine.engine import EngineError
from dspark.sampling_params import SamplingParamsError
from dspark.serve.async_engine import EngineDeadError, QueueFullError, RequestFailedError
from dspark.serve.protocol import ErrorInfo, ErrorResponse

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

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
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
    return APIError(e.status_code, str(e.detail), kind, None, code).response()


def install_error_handlers(app: FastAPI) -> None:
    for cls in (APIError, EngineError, SamplingParamsError, EngineDeadError, RequestFailedError):
        app.add_exception_handler(cls, _known_error)
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
