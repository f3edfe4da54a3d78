"""The OpenAI-compatible HTTP server: ``create_app(engine, api_key=None, model_name=None) -> FastAPI``.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE with ``stream: true``), GET /v1/models,
GET /health, GET /metrics (Prometheus text), GET /version, POST /tokenize, POST /detokenize.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (malformed JSON,
bad sampling values, max_tokens out of range, prompts longer than the context), 401 for a missing/wrong API key
(every route but /health), 404 for an unknown model or route, 503 when the waiting queue is full, 500 otherwise.

Chat prompts are ``apply_chat_template(messages, add_generation_prompt=True)`` of the model's tokenizer (its
Jinja ``chat_template`` from tokenizer_config.json), encoded without adding special tokens (the template places
them). A chat request without max_tokens generates up to ``CHAT_DEFAULT_MAX_TOKENS`` (256) tokens, capped by what
the context leaves after the prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark import __version__
from dspark.engine.engine import Engine, EngineError, RequestOutput
from dspark.sampling_params import SamplingParams, SamplingParamsError
from dspark.serve.async_engine import (
    AsyncEngine,
    EngineDeadError,
    IncrementalText,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from dspark.serve.metrics import CONTENT_TYPE, ServerMetrics
from dspark.serve.protocol import (
    CHAT_DEFAULT_MAX_TOKENS,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseMetrics,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    random_id,
    spec_metrics_of,
)

OPEN_PATHS = frozenset({"/health"})


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


def error_response(
    status: int, message: str, type: str, param: str | None = None, code: str | None = None, headers=None
) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _from_exception(e: BaseException) -> APIError:
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


class _ApiKeyMiddleware:
    """Pure ASGI (does not wrap response bodies, so streaming and disconnects behave as without it)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                resp = error_response(
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key the "
                    "server was started with (--api-key)",
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- helpers -----------------------------------------------------------------------------------------------


def encode_prompt(engine: Engine, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids exactly as AutoTokenizer gives them (``Engine.add_request`` of a string: special tokens added)."""
    return engine.tokenizer.encode(text, add_special_tokens)


def render_chat(engine: Engine, messages: Sequence[ChatMessage]) -> str:
    turns = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            bad = [p.type for p in m.content if p.type != "text"]
            if bad:
                raise APIError(
                    400,
                    f"messages[{i}].content: only 'text' parts are supported (got {bad[0]!r})",
                    param=f"messages.{i}.content",
                )
            content = "".join(p.text or "" for p in m.content)
        else:
            content = m.content or ""
        turns.append({"role": m.role, "content": content})
    return engine.tokenizer.apply_chat_template(turns)


def _check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.n != 1:
        raise APIError(400, f"n={req.n} is not supported: only n=1; send several requests instead", param="n")
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, 1):
            raise APIError(400, f"best_of={req.best_of} is not supported: only 1", param="best_of")
        if req.logprobs is not None:
            raise APIError(400, "logprobs are not supported by the dspark server; omit 'logprobs'", param="logprobs")
        if req.echo:
            raise APIError(400, "echo is not supported by the dspark server; omit 'echo'", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported by the dspark server; omit 'suffix'", param="suffix")
    elif req.logprobs or req.top_logprobs:
        raise APIError(400, "logprobs are not supported by the dspark server; omit 'logprobs'", param="logprobs")


def _check_length(engine: Engine, n_prompt: int, max_tokens: int, prompt_param: str) -> None:
    limit = engine.max_model_len
    if n_prompt >= limit:
        raise APIError(
            400,
            f"the prompt has {n_prompt} tokens but the model's context length is {limit} (and at least one token "
            "must be generated); shorten the prompt",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens < 1:
        raise APIError(400, f"max_tokens={max_tokens} is invalid: it must be at least 1", param="max_tokens")
    if n_prompt + max_tokens > limit:
        raise APIError(
            400,
            f"max_tokens={max_tokens} is too large: the prompt has {n_prompt} tokens and the model's context length "
            f"is {limit}, so at most {limit - n_prompt} tokens can be generated; lower max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )


def _sampling(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        max_tokens=max_tokens,
        seed=req.seed,
        stop=tuple(stop),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        n=req.n,
    )


def _usage(outs: Sequence[RequestOutput | None], prompt_lens: Sequence[int]) -> UsageInfo:
    p = sum(prompt_lens)
    c = sum(len(o.token_ids) for o in outs if o is not None)
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def _sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


async def _merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, snapshot) from several request streams as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            q.put_nowait((i, e))
        q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _field_path(loc: Sequence[Any]) -> list[str]:
    """A pydantic error location as field names (drops 'body' and union-branch tags like 'list[int]')."""
    return [str(x) for x in loc if x != "body" and not ("[" in str(x) or str(x) in _TYPE_TAGS)]


class _ClientGone(Exception):
    pass


async def _wait_final(streams: Sequence[RequestStream], request: Request) -> list[RequestOutput]:
    """Every stream's final output; aborts them all if the client disconnects first."""
    task = asyncio.ensure_future(asyncio.gather(*(s.final() for s in streams)))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return list(task.result())
            if await request.is_disconnected():
                raise _ClientGone()
    finally:
        if not task.done():
            task.add_done_callback(lambda t: None if t.cancelled() else t.exception())  # retrieved: no warning
            task.cancel()
        for s in streams:
            s.abort()  # no-op for finished ones


# ---- the app -----------------------------------------------------------------------------------------------


class ServerState:
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.async_engine = AsyncEngine(engine)
        self.metrics = ServerMetrics(engine, model_name, self.async_engine.lock)
        self.async_engine.on_outputs = self.metrics.record

    def check_model(self, model: str | None) -> None:
        root = str(self.engine.model_dir or "")
        if model is not None and model not in (self.model_name, root):
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    @property
    def num_spec_tokens(self) -> int:
        return self.engine.K

    def response_metrics(self, out: RequestOutput) -> ResponseMetrics | None:
        spec = spec_metrics_of(out.spec_metrics, self.num_spec_tokens)
        return ResponseMetrics(speculative_decoding=spec) if spec is not None else None

    async def submit(self, prompts: Sequence[list[int]], params: SamplingParams, prefix: str) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                rid = prefix if len(prompts) == 1 else f"{prefix}-{i}"
                streams.append(await self.async_engine.add(ids, params, rid))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams


def default_model_name(engine: Engine) -> str:
    d = engine.model_dir
    return d.name if d is not None else "dspark"


def create_app(engine: Engine, api_key: str | None = None, model_name: str | None = None) -> FastAPI:
    state = ServerState(engine, model_name or default_model_name(engine))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.async_engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            state.async_engine.shutdown()

    app = FastAPI(title="dspark", version=__version__, lifespan=lifespan)
    app.state.dspark = state
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = _field_path(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            msg = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
            return error_response(400, msg, "invalid_request_error", None, "invalid_json")
        if not loc and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
            msg = "the request body must be a JSON object (with the header Content-Type: application/json)"
            return error_response(400, msg, "invalid_request_error", None, "invalid_json")
        param = ".".join(loc) or None
        details = "; ".join(
            f"{'.'.join(_field_path(err.get('loc', ()))) or 'body'}: {err.get('msg')}" for err in errs[:5]
        )
        return error_response(400, f"invalid request: {details}", "invalid_request_error", param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind, None, None)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        err = _from_exception(e)
        return error_response(err.status, err.message, err.type, err.param, err.code)

    async def run(coro):
        try:
            return await coro
        except (QueueFullError, SamplingParamsError, EngineError, EngineDeadError, RequestFailedError) as e:
            err = _from_exception(e)
            headers = {"Retry-After": "1"} if err.status == 503 else None
            return error_response(err.status, err.message, err.type, err.param, err.code, headers)

    # ---- generation routes ---------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await run(_completions(req, request))

    async def _completions(req: CompletionRequest, request: Request):
        state.check_model(req.model)
        _check_unsupported(req)
        prompts = _completion_prompts(req)
        limit = engine.max_model_len
        outs_max = [req.max_tokens if req.max_tokens is not None else max(1, limit - len(p)) for p in prompts]
        for p, m in zip(prompts, outs_max):
            _check_length(engine, len(p), m, "prompt")
        params = _sampling(req, outs_max[0]) if len(set(outs_max)) == 1 else None
        if params is None:  # max_tokens=null with prompts of different lengths
            raise APIError(400, "give max_tokens when sending several prompts", param="max_tokens")
        rid = random_id("cmpl")
        streams = await state.submit(prompts, params, rid)
        if req.stream:
            return _streaming(_completion_events(req, rid, streams, params), streams)
        try:
            finals = await _wait_final(streams, request)
        except _ClientGone:
            return Response(status_code=499)
        ids = req.return_token_ids
        choices = [
            CompletionChoice(
                index=i,
                text=o.text,
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
                token_ids=o.token_ids if ids else None,
                prompt_token_ids=o.prompt_token_ids if ids else None,
            )
            for i, o in enumerate(finals)
        ]
        usage = _usage(finals, [len(p) for p in prompts])
        metrics = state.response_metrics(finals[0]) if len(finals) == 1 else None
        return CompletionResponse(id=rid, model=state.model_name, choices=choices, usage=usage, metrics=metrics)

    def _completion_prompts(req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            return [encode_prompt(engine, p)]
        if not p:
            raise APIError(400, "prompt is empty; give a string or a list of token ids", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        out = []
        for x in p:
            ids = encode_prompt(engine, x) if isinstance(x, str) else list(x)  # type: ignore[arg-type]
            if not ids:
                raise APIError(400, "prompt is empty; give a string or a list of token ids", param="prompt")
            out.append(ids)
        return out

    async def _completion_events(
        req: CompletionRequest, rid: str, streams: list[RequestStream], params: SamplingParams
    ) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
        texts = [IncrementalText(params.stop) for _ in streams]
        last: list[RequestOutput | None] = [None] * len(streams)
        lens = [s.num_prompt_tokens for s in streams]
        async for i, out in _merged(streams):
            last[i] = out
            delta = texts[i].update(out.text, out.finished)
            if not delta and not out.finished:
                continue
            choice = CompletionChoice(
                index=i,
                text=delta,
                finish_reason=out.finish_reason if out.finished else None,
                stop_reason=out.stop_reason if out.finished else None,
            )
            chunk = CompletionStreamResponse(id=rid, model=state.model_name, choices=[choice])
            if continuous:
                chunk.usage = _usage([out], [lens[i]])
            if out.finished and len(streams) == 1:
                chunk.metrics = state.response_metrics(out)
            yield _sse(chunk)
        if include_usage:
            final = CompletionStreamResponse(id=rid, model=state.model_name, choices=[], usage=_usage(last, lens))
            if len(streams) == 1 and last[0] is not None:
                final.metrics = state.response_metrics(last[0])
            yield _sse(final)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await run(_chat(req, request))

    async def _chat(req: ChatCompletionRequest, request: Request):
        state.check_model(req.model)
        _check_unsupported(req)
        ids = encode_prompt(engine, render_chat(engine, req.messages), add_special_tokens=False)  # template's own
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(CHAT_DEFAULT_MAX_TOKENS, engine.max_model_len - len(ids)))
        _check_length(engine, len(ids), max_tokens, "messages")
        params = _sampling(req, max_tokens)
        rid = random_id("chatcmpl")
        streams = await state.submit([ids], params, rid)
        if req.stream:
            return _streaming(_chat_events(req, rid, streams[0], params), streams)
        try:
            (final,) = await _wait_final(streams, request)
        except _ClientGone:
            return Response(status_code=499)
        choice = ChatChoice(
            index=0,
            message=AssistantMessage(content=final.text),
            finish_reason=final.finish_reason,
            stop_reason=final.stop_reason,
            token_ids=final.token_ids if req.return_token_ids else None,
            prompt_token_ids=final.prompt_token_ids if req.return_token_ids else None,
        )
        return ChatCompletionResponse(
            id=rid,
            model=state.model_name,
            choices=[choice],
            usage=_usage([final], [len(ids)]),
            metrics=state.response_metrics(final),
        )

    async def _chat_events(
        req: ChatCompletionRequest, rid: str, stream: RequestStream, params: SamplingParams
    ) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
        n_prompt = stream.num_prompt_tokens

        def chunk(delta: DeltaMessage, out: RequestOutput | None = None) -> ChatCompletionStreamResponse:
            done = out is not None and out.finished
            c = ChatStreamChoice(
                index=0,
                delta=delta,
                finish_reason=out.finish_reason if done else None,
                stop_reason=out.stop_reason if done else None,
            )
            resp = ChatCompletionStreamResponse(id=rid, model=state.model_name, choices=[c])
            if continuous:
                resp.usage = _usage([out], [n_prompt])
            if done:
                resp.metrics = state.response_metrics(out)
            return resp

        yield _sse(chunk(DeltaMessage(role="assistant", content="")))
        text = IncrementalText(params.stop)
        last = None
        async for _, out in _merged([stream]):
            last = out
            delta = text.update(out.text, out.finished)
            if delta or out.finished:
                yield _sse(chunk(DeltaMessage(content=delta or None), out))
        if include_usage:
            final = ChatCompletionStreamResponse(
                id=rid, model=state.model_name, choices=[], usage=_usage([last], [n_prompt])
            )
            if last is not None:
                final.metrics = state.response_metrics(last)
            yield _sse(final)

    def _streaming(events: AsyncIterator[str], streams: Sequence[RequestStream]) -> StreamingResponse:
        return StreamingResponse(_framed(events, streams), media_type="text/event-stream")

    async def _framed(events: AsyncIterator[str], streams: Sequence[RequestStream]) -> AsyncIterator[str]:
        """SSE framing: errors become an in-band error event, the stream always ends with ``data: [DONE]``, and
        closing it early (client disconnect) aborts the unfinished requests, returning their cache pages."""
        try:
            async for e in events:
                yield e
        except Exception as e:  # noqa: BLE001 - reported in-band: the status line was already sent
            err = _from_exception(e)
            yield _sse(ErrorResponse(error=ErrorInfo(message=err.message, type=err.type, code=err.code)))
        finally:
            for s in streams:
                s.abort()  # no-op for finished requests
            await events.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"

    # ---- other routes --------------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models() -> ModelList:
        root = engine.model_dir
        card = ModelCard(id=state.model_name, root=str(root) if root else None, max_model_len=engine.max_model_len)
        return ModelList(data=[card])

    @app.get("/health")
    async def health() -> Response:
        if not state.async_engine.alive:
            return error_response(503, "the engine loop stopped after an error", "server_error", None, "engine_dead")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    def metrics() -> Response:  # sync: runs in the threadpool, may wait for the engine lock
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' (a string) or 'messages' (a chat)", param="prompt")
        text = req.prompt if req.prompt is not None else render_chat(engine, req.messages or [])
        explicit = req.prompt is not None or "add_special_tokens" in req.model_fields_set  # chat default: vLLM's False
        ids = encode_prompt(engine, text, req.add_special_tokens and explicit)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        state.check_model(req.model)
        vocab = engine.target.config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(list(req.tokens)))

    return app
