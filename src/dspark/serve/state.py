"""The one object every route shares: ``ServerState`` (``get_state`` / ``State`` hand it to a route)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, TypeVar

from fastapi import Depends, Request

from dspark.engine.engine import Engine, RequestOutput
from dspark.sampling_params import SamplingParams
from dspark.serve.async_engine import AsyncEngine, RequestStream
from dspark.serve.config import ServerConfig
from dspark.serve.errors import APIError
from dspark.serve.kv_inbox import KVInbox
from dspark.serve.metrics import ServerMetrics
from dspark.serve.protocol import ResponseMetrics, spec_metrics_of

T = TypeVar("T")


def default_model_name(engine: Engine) -> str:
    """The model as the user named it (an alias or hub id as given; a local directory or .gguf file by its name),
    else the model directory's name."""
    ref = engine.model_ref
    if ref is not None:
        return Path(ref).name if Path(ref).exists() else ref
    d = engine.model_dir
    return d.name if d is not None else "dspark"


class ServerState:
    """The engine, its asyncio front, the metrics registry and the tokenizer thread, shared by every router."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.model_name = config.served_model_name or default_model_name(engine)
        self.async_engine = AsyncEngine(engine)
        self.metrics = ServerMetrics(engine, self.model_name, self.async_engine.lock)
        self.async_engine.on_outputs = self.metrics.record
        self.inbox = KVInbox()  # P/D decode: payloads pushed by prefill instances (serve/disagg.py)
        self._tokenizer_thread: ThreadPoolExecutor | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.async_engine.start(loop)

    def shutdown(self) -> None:
        self.async_engine.shutdown()
        self.engine.close()
        if self._tokenizer_thread is not None:
            self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
            self._tokenizer_thread = None

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """Run fn on the tokenizer thread: tokenizing (and chat templating) a long prompt takes seconds, and the
        event loop must keep answering other clients and /health meanwhile. One thread, because a fast tokenizer
        may not be entered from two threads at once."""
        if self._tokenizer_thread is None:
            self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="dspark-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def check_model(self, model: str | None) -> None:
        root = str(self.engine.model_dir or "")
        if model is not None and model not in (self.model_name, root):
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def response_metrics(self, out: RequestOutput | None) -> ResponseMetrics | None:
        spec = spec_metrics_of(out.spec_metrics, self.engine.K) if out is not None else None
        return ResponseMetrics(speculative_decoding=spec) if spec is not None else None

    async def submit(
        self, prompts: Sequence[list[int]], params: Sequence[SamplingParams], prefix: str, export: bool = False
    ) -> list[RequestStream]:
        """One engine request per prompt, with its own params (ids ``prefix`` or ``prefix-i``); all or none are
        added. ``export``: P/D prefills (``AsyncEngine.add``)."""
        streams: list[RequestStream] = []
        try:
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
                rid = prefix if len(prompts) == 1 else f"{prefix}-{i}"
                streams.append(await self.async_engine.add(ids, p, rid, export))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams


def get_state(request: Request) -> ServerState:
    return request.app.state.dspark


State = Annotated[ServerState, Depends(get_state)]
