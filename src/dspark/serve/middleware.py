"""Pure ASGI middlewares (they do not wrap response bodies, so streaming and disconnects behave as without them).

``ApiKeyMiddleware`` (outermost): 401 without the right bearer key. ``BodyLimitMiddleware``: 413 for a body over
``--max-request-bytes``, by its Content-Length or while it streams in. ``ErrorMiddleware`` (innermost): an
unexpected exception becomes an OpenAI-shaped 500 *response*, so the connection stays open for the next request
(left to Starlette, the exception would reach the server, which then drops the keep-alive connection).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.serve.errors import APIError, api_error_of

logger = logging.getLogger("dspark.serve")

OPEN_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                err = APIError(
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key the "
                    "server was started with (--api-key or DSPARK_API_KEY)",
                    code="invalid_api_key",
                )
                await err.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


KV_TRANSFER_PATH = "/v1/kv_transfer/"  # P/D payloads (serve/disagg.py): their own, larger limit


def _too_large(limit: int, flag: str) -> str:
    return (
        f"the request body is larger than {limit} bytes, the server's limit ({flag}); "
        "send a smaller request or raise the limit"
    )


class BodyLimitMiddleware:
    def __init__(self, app: Any, max_bytes: int, max_kv_transfer_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_kv_transfer_bytes = max_kv_transfer_bytes or max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, flag = self.max_bytes, "--max-request-bytes"
        if scope["path"].startswith(KV_TRANSFER_PATH):
            limit, flag = self.max_kv_transfer_bytes, "--max-kv-transfer-bytes"
        declared = dict(scope.get("headers") or []).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > limit:
            err = APIError(413, _too_large(limit, flag), param=None, code="request_too_large")
            return await err.response({"Connection": "close"})(scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:  # a chunked body without Content-Length: stop reading it
                raise StarletteHTTPException(413, _too_large(limit, flag))
            return message

        await self.app(scope, counted, send)


class ErrorMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            if started:  # the status line is out: nothing left to do but let the server close the connection
                raise
            logger.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            await api_error_of(e).response()(scope, receive, send)
