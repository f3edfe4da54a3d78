"""Waiting on engine requests from a route: every final output (aborting all if the client leaves), or SSE
framing of a stream of chunks (in-band error event, ``data: [DONE]``, abort on disconnect)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from dspark.engine.engine import RequestOutput
from dspark.serve.async_engine import RequestStream
from dspark.serve.errors import api_error_of
from dspark.serve.protocol import UsageInfo

_DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks whether its client is still there


class ClientGone(Exception):
    """The client disconnected before its (non-streaming) answer was ready; its requests were aborted."""


def usage(outs: Sequence[RequestOutput | None], prompt_lens: Sequence[int]) -> UsageInfo:
    p = sum(prompt_lens)
    c = sum(len(o.token_ids) for o in outs if o is not None)
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


async def merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def wait_final(streams: Sequence[RequestStream], request: Request) -> list[RequestOutput]:
    """Every stream's final output; aborts them all if the client disconnects first (raises ``ClientGone``)."""
    task = asyncio.ensure_future(asyncio.gather(*(s.final() for s in streams)))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return list(task.result())
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.add_done_callback(lambda t: None if t.cancelled() else t.exception())  # retrieved: no warning
            task.cancel()
        for s in streams:
            s.abort()  # no-op for finished ones


def event_stream_of(chunk: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI 200 response of a route that streams with ``stream: true``: its JSON body (the route's
    response model) or server-sent events. Before OpenAPI 3.2 the ``schema`` of text/event-stream describes one
    event (``data``, and the optional ``event`` / ``id`` / ``retry`` fields); ``data`` is one ``chunk`` JSON object,
    an error object (an error after the stream started), or ``[DONE]``, the last event."""
    data = f"One {chunk.__name__} JSON object, an ErrorResponse JSON object, or '[DONE]' (the last event)."
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"type": "string", "description": data},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
    }
    return {
        "description": "The response object, or with stream: true a stream of server-sent events.",
        "content": {"text/event-stream": {"schema": event}},
    }


def streaming_response(events: AsyncIterator[str], streams: Sequence[RequestStream]) -> StreamingResponse:
    return StreamingResponse(_framed(events, streams), media_type="text/event-stream")


async def _framed(events: AsyncIterator[str], streams: Sequence[RequestStream]) -> AsyncIterator[str]:
    """SSE framing: errors become an in-band error event, the stream always ends with ``data: [DONE]``, and
    closing it early (client disconnect) aborts the unfinished requests, returning their cache pages."""
    try:
        async for e in events:
            yield e
    except Exception as e:  # noqa: BLE001 - reported in-band: the status line was already sent
        yield sse(api_error_of(e).body)
    finally:
        for s in streams:
            s.abort()  # no-op for finished requests
        await events.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"
