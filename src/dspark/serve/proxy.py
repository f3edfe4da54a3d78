"""``dspark serve-proxy``: the front of a prefill/decode (P/D) disaggregated deployment.

A client sends an ordinary /v1/completions or /v1/chat/completions request (JSON or SSE) to the proxy. The proxy
gives it a transfer id and sends it to the prefill instance (``dspark serve --role prefill``) with
``kv_transfer_params.do_remote_decode``: that instance runs the prompt, samples the first token and pushes the
request's state to the decode instance. Then the proxy forwards the request to the decode instance (``--role
decode``) with ``do_remote_prefill`` and passes its answer, streamed or not, back unchanged: the decode instance
continues with speculation from the shipped state.

Nothing is lost when a step fails, and each fallback logs one warning line: the prefill instance down or failing →
the decode instance gets the plain request (it prefills itself); the push failed → the same; the decode instance
down → the prefill instance serves the whole request. A client error (4xx other than 408/429) from the prefill
instance is the answer (the decode instance would refuse the request the same way). Routes: POST /v1/completions,
POST /v1/chat/completions, GET /v1/models (the decode instance's), GET /health (both instances'), GET /metrics
(``dspark:proxy_requests_total{path}``: how each request was served).
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from starlette.background import BackgroundTask

from dspark import __version__
from dspark.serve.metrics import CONTENT_TYPE

logger = logging.getLogger("dspark.serve.proxy")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
PASSED_HEADERS = ("authorization",)
# how a request was served: prefill + decode with a transfer, decode alone (prefill or push failed), prefill alone
# (decode down), or forwarded as is (a batch of prompts, a body that is not JSON)
OUTCOMES = ("disaggregated", "decode_only", "prefill_only", "forwarded")


class Proxy:
    def __init__(self, prefill: str, decode: str, timeout_s: float = 600.0) -> None:
        self.prefill, self.decode = prefill.rstrip("/"), decode.rstrip("/")
        self.timeout = httpx.Timeout(timeout_s, connect=10.0)
        self.client: httpx.AsyncClient | None = None
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dspark:proxy_requests", "Requests by how they were served.", ["path"], registry=self.registry
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)

    @property
    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            self.client = httpx.AsyncClient(timeout=self.timeout)
        return self.client

    async def handle(self, request: Request) -> Response:
        path, raw = request.url.path, await request.body()
        headers = {k: v for k, v in request.headers.items() if k in PASSED_HEADERS}
        body = _json_object(raw)
        stream = bool(body and body.get("stream"))
        if body is None or not _single_prompt(body):
            self.requests.labels("forwarded").inc()
            return await self._forward(self.decode, path, raw, headers, stream)
        tid = f"xfer-{uuid.uuid4().hex}"
        sent = await self._prefill(path, body, tid, headers)
        if isinstance(sent, Response):
            return sent
        outgoing = body | {"kv_transfer_params": {"transfer_id": tid, "do_remote_prefill": True}} if sent else body
        try:
            response = await self._forward(self.decode, path, _dump(outgoing), headers, stream)
            outcome = "disaggregated" if sent else "decode_only"
        except httpx.TransportError as e:
            logger.warning(
                "decode instance %s unreachable (%s: %s); the prefill instance serves the whole request",
                self.decode,
                type(e).__name__,
                e,
            )
            response = await self._forward(self.prefill, path, raw, headers, stream)
            outcome = "prefill_only"
        self.requests.labels(outcome).inc()
        return response

    async def _prefill(self, path: str, body: dict, tid: str, headers: dict) -> bool | Response:
        """Run the prompt on the prefill instance: True when the state reached the decode instance; the prefill
        instance's answer when the request itself is bad; False when the decode instance must prefill."""
        kv = {"transfer_id": tid, "do_remote_decode": True, "decode_url": self.decode}
        job = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False, "kv_transfer_params": kv}
        try:
            r = await self.http.post(self.prefill + path, content=_dump(job), headers=headers | _JSON)
        except httpx.HTTPError as e:
            logger.warning(
                "prefill instance %s failed (%s: %s); sending the plain request to the decode instance",
                self.prefill,
                type(e).__name__,
                e,
            )
            return False
        if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        result = _kv_result(r)
        if result.get("status") == "sent":
            return True
        reason = result.get("error") or f"HTTP {r.status_code}: {r.text[:300]}"
        logger.warning(
            "kv transfer %s did not reach the decode instance (%s); it prefills the request itself", tid, reason
        )
        return False

    async def _forward(self, base: str, path: str, content: bytes, headers: dict, stream: bool) -> Response:
        """POST to ``base`` and pass the answer back (streamed when the request streams)."""
        req = self.http.build_request("POST", base + path, content=content, headers=headers | _JSON)
        resp = await self.http.send(req, stream=stream)
        media = resp.headers.get("content-type")
        if not stream:
            return Response(resp.content, resp.status_code, media_type=media)
        return StreamingResponse(
            _relay(resp), resp.status_code, media_type=media, background=BackgroundTask(resp.aclose)
        )

    async def get(self, path: str, headers: dict) -> Response:
        """GET from the decode instance, else (down) from the prefill instance: both serve the same model."""
        try:
            r = await self.http.get(self.decode + path, headers=headers)
        except httpx.TransportError:
            r = await self.http.get(self.prefill + path, headers=headers)
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    async def health(self) -> Response:
        down = []
        for name, base in (("prefill", self.prefill), ("decode", self.decode)):
            try:
                ok = (await self.http.get(base + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(f"{name} instance {base}")
        if down:
            return JSONResponse({"error": {"message": f"unhealthy: {', '.join(down)}", "type": "server_error"}}, 503)
        return Response(status_code=200)


_JSON = {"content-type": "application/json"}


async def _relay(resp: httpx.Response) -> AsyncIterator[bytes]:
    async for chunk in resp.aiter_raw():
        yield chunk


def _kv_result(r: httpx.Response) -> dict:
    """The prefill instance's ``kv_transfer_params`` answer ({} when there is none)."""
    try:
        body = r.json() if r.status_code == 200 else {}
    except ValueError:
        return {}
    result = body.get("kv_transfer_params") if isinstance(body, dict) else None
    return result if isinstance(result, dict) else {}


def _dump(body: dict) -> bytes:
    return json.dumps(body).encode()


def _json_object(raw: bytes) -> dict | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _single_prompt(body: dict[str, Any]) -> bool:
    """A chat, or a completion of one prompt (a string or one list of token ids): what one transfer carries."""
    if "messages" in body:
        return True
    prompt = body.get("prompt")
    return isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))


def create_proxy_app(prefill: str, decode: str, timeout_s: float = 600.0) -> FastAPI:
    proxy = Proxy(prefill, decode, timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if proxy.client is not None:
            await proxy.client.aclose()

    app = FastAPI(title="dspark P/D proxy", version=__version__, lifespan=lifespan)
    app.state.proxy = proxy
    for path in GENERATION_PATHS:
        app.add_api_route(path, proxy.handle, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k in PASSED_HEADERS}
        return await proxy.get("/v1/models", headers)

    app.add_api_route("/health", proxy.health, methods=["GET"])

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(proxy.registry), media_type=CONTENT_TYPE)

    return app
