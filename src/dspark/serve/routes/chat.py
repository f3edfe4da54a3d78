"""POST /v1/chat/completions: JSON or SSE. Without max_tokens a chat generates up to ``CHAT_DEFAULT_MAX_TOKENS``
(256), capped by what the context leaves after the prompt."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from dspark.engine.engine import RequestOutput
from dspark.sampling_params import SamplingParams
from dspark.serve.async_engine import IncrementalText, RequestStream
from dspark.serve.disagg import open_streams, prefill_for_remote_decode
from dspark.serve.errors import GENERATION_ERRORS
from dspark.serve.inputs import check_length, encode_chat, sampling_params_of
from dspark.serve.protocol import (
    CHAT_DEFAULT_MAX_TOKENS,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    DeltaMessage,
)
from dspark.serve.protocol import random_id as new_id
from dspark.serve.state import ServerState, State
from dspark.serve.streaming import ClientGone, event_stream_of, merged, sse, streaming_response, usage, wait_final

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={200: event_stream_of(ChatCompletionStreamResponse)} | GENERATION_ERRORS,
)
async def chat_completions(req: ChatCompletionRequest, request: Request, state: State):
    state.check_model(req.model)
    ids = await state.off_loop(encode_chat, state.engine, req.messages)
    params = _params(state, req, len(ids))
    rid = new_id("chatcmpl")
    kv = req.kv_transfer_params
    if kv is not None and kv.do_remote_decode:  # P/D prefill: the first token here, the rest on a decode instance
        return await prefill_for_remote_decode(
            state, request, kv, [ids], [params], rid, lambda out: _response(state, req, rid, out, len(ids))
        )
    streams = await open_streams(state, [ids], [params], rid, kv)  # P/D decode: continued from a shipped state
    if req.stream:
        return streaming_response(_events(state, req, rid, streams[0], params), streams)
    try:
        (final,) = await wait_final(streams, request)
    except ClientGone:
        return Response(status_code=499)
    return _response(state, req, rid, final, len(ids))


def _params(state: ServerState, req: ChatCompletionRequest, n_prompt: int) -> SamplingParams:
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = max(1, min(CHAT_DEFAULT_MAX_TOKENS, state.engine.max_model_len - n_prompt))
    check_length(state.engine, n_prompt, max_tokens, "messages")
    return sampling_params_of(req, max_tokens)


def _response(
    state: ServerState, req: ChatCompletionRequest, rid: str, final: RequestOutput, n_prompt: int
) -> ChatCompletionResponse:
    ids = req.return_token_ids
    choice = ChatChoice(
        index=0,
        message=AssistantMessage(content=final.text),
        finish_reason=final.finish_reason,
        stop_reason=final.stop_reason,
        token_ids=final.token_ids if ids else None,
        prompt_token_ids=final.prompt_token_ids if ids else None,
    )
    return ChatCompletionResponse(
        id=rid,
        model=state.model_name,
        choices=[choice],
        usage=usage([final], [n_prompt]),
        metrics=state.response_metrics(final),
    )


def _chunk(
    state: ServerState, rid: str, delta: DeltaMessage, out: RequestOutput | None, n_prompt: int, continuous: bool
) -> ChatCompletionStreamResponse:
    done = out is not None and out.finished
    choice = ChatStreamChoice(
        index=0,
        delta=delta,
        finish_reason=out.finish_reason if done else None,
        stop_reason=out.stop_reason if done else None,
    )
    resp = ChatCompletionStreamResponse(id=rid, model=state.model_name, choices=[choice])
    resp.usage = usage([out], [n_prompt]) if continuous else None
    resp.metrics = state.response_metrics(out) if done else None
    return resp


async def _events(
    state: ServerState, req: ChatCompletionRequest, rid: str, stream: RequestStream, params: SamplingParams
) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
    n_prompt = stream.num_prompt_tokens
    yield sse(_chunk(state, rid, DeltaMessage(role="assistant", content=""), None, n_prompt, continuous))
    text = IncrementalText(params.stop)
    last = None
    async for _, out in merged([stream]):
        last = out
        delta = text.update(out.text, out.finished)
        if delta or out.finished:
            yield sse(_chunk(state, rid, DeltaMessage(content=delta or None), out, n_prompt, continuous))
    if include_usage:
        final = ChatCompletionStreamResponse(id=rid, model=state.model_name, choices=[])
        final.usage, final.metrics = usage([last], [n_prompt]), state.response_metrics(last)
        yield sse(final)
