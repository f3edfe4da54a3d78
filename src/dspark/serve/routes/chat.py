"""POST /v1/chat/completions: ``n`` samples, JSON or SSE. Without max_tokens a chat generates up to
``CHAT_DEFAULT_MAX_TOKENS`` (256), capped by what the context leaves after the prompt."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from dspark.engine.engine import RequestOutput
from dspark.sampling_params import SamplingParams
from dspark.serve.async_engine import IncrementalText, RequestStream
from dspark.serve.disagg import open_streams, prefill_for_remote_decode
from dspark.serve.errors import GENERATION_ERRORS
from dspark.serve.inputs import check_length, check_samples, encode_chat, sampling_params_of
from dspark.serve.logprobs import chat_logprobs
from dspark.serve.protocol import (
    CHAT_DEFAULT_MAX_TOKENS,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
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
    check_samples(1, req.n, state.config.max_prompts_per_request)
    ids = await state.off_loop(encode_chat, state.engine, req.messages)
    params = await state.off_loop(_params, state, req, len(ids))  # a grammar compiles here
    rid = new_id("chatcmpl")
    kv = req.kv_transfer_params
    if kv is not None and kv.do_remote_decode:  # P/D prefill: the first token here, the rest on a decode instance
        return await prefill_for_remote_decode(
            state, request, kv, [ids], [params], rid, lambda out: _response(state, req, rid, [out], len(ids))
        )
    samples = params.samples()
    streams = await open_streams(state, [ids] * len(samples), samples, rid, kv)  # P/D decode: from a shipped state
    if req.stream:
        return streaming_response(_events(state, req, rid, streams, samples), streams)
    try:
        finals = await wait_final(streams, request)
    except ClientGone:
        return Response(status_code=499)
    return _response(state, req, rid, finals, len(ids))


def _params(state: ServerState, req: ChatCompletionRequest, n_prompt: int) -> SamplingParams:
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = max(1, min(CHAT_DEFAULT_MAX_TOKENS, state.engine.max_model_len - n_prompt))
    check_length(state.engine, n_prompt, max_tokens, "messages")
    return sampling_params_of(state.engine, req, max_tokens)


def _logprobs(state: ServerState, out: RequestOutput, first: int = 0) -> ChatLogprobs | None:
    """The logprobs of the sample's tokens from ``first`` on (None unless the request asked for them)."""
    sample = out.outputs[0]
    if sample.logprobs is None:
        return None
    return chat_logprobs(state.engine.tokenizer, sample.token_ids[first:], sample.logprobs[first:])


def _response(
    state: ServerState, req: ChatCompletionRequest, rid: str, finals: list[RequestOutput], n_prompt: int
) -> ChatCompletionResponse:
    ids = req.return_token_ids
    choices = [
        ChatChoice(
            index=i,
            message=AssistantMessage(content=final.text),
            logprobs=_logprobs(state, final),
            finish_reason=final.finish_reason,
            stop_reason=final.stop_reason,
            token_ids=final.token_ids if ids else None,
            prompt_token_ids=final.prompt_token_ids if ids else None,
        )
        for i, final in enumerate(finals)
    ]
    return ChatCompletionResponse(
        id=rid,
        model=state.model_name,
        choices=choices,
        usage=usage(finals, [n_prompt]),
        metrics=state.response_metrics(finals[0]) if len(finals) == 1 else None,
    )


def _chunk(
    state: ServerState,
    rid: str,
    index: int,
    delta: DeltaMessage,
    out: RequestOutput | None,
    logprobs: ChatLogprobs | None,
    n_prompt: int,
    continuous: bool,
    single: bool,
) -> ChatCompletionStreamResponse:
    done = out is not None and out.finished
    choice = ChatStreamChoice(
        index=index,
        delta=delta,
        logprobs=logprobs,
        finish_reason=out.finish_reason if done else None,
        stop_reason=out.stop_reason if done else None,
    )
    resp = ChatCompletionStreamResponse(id=rid, model=state.model_name, choices=[choice])
    resp.usage = usage([out], [n_prompt]) if continuous else None
    resp.metrics = state.response_metrics(out) if done and single else None
    return resp


async def _events(
    state: ServerState,
    req: ChatCompletionRequest,
    rid: str,
    streams: list[RequestStream],
    samples: list[SamplingParams],
) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
    n_prompt, single = streams[0].num_prompt_tokens, len(streams) == 1
    for i in range(len(streams)):
        role = DeltaMessage(role="assistant", content="")
        yield sse(_chunk(state, rid, i, role, None, None, n_prompt, continuous, single))
    texts = [IncrementalText(p.stop) for p in samples]
    sent = [0] * len(streams)  # tokens whose logprobs were sent, per choice
    last: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merged(streams):
        last[i] = out
        delta = texts[i].update(out.text, out.finished)
        if delta or out.finished:
            logprobs = _logprobs(state, out, sent[i])
            sent[i] = len(out.token_ids)
            message = DeltaMessage(content=delta or None)
            yield sse(_chunk(state, rid, i, message, out, logprobs, n_prompt, continuous, single))
    if include_usage:
        final = ChatCompletionStreamResponse(id=rid, model=state.model_name, choices=[])
        final.usage = usage(last, [n_prompt])
        final.metrics = state.response_metrics(last[0]) if single else None
        yield sse(final)
