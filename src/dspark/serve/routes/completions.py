"""POST /v1/completions: one prompt or a batch, JSON or SSE (``stream: true``). Without max_tokens (null) each
prompt generates up to what the context leaves after it."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from dspark.engine.engine import RequestOutput
from dspark.sampling_params import SamplingParams
from dspark.serve.async_engine import IncrementalText, RequestStream
from dspark.serve.disagg import open_streams, prefill_for_remote_decode
from dspark.serve.errors import GENERATION_ERRORS
from dspark.serve.inputs import check_length, encode_completion_prompts, sampling_params_of
from dspark.serve.protocol import CompletionChoice, CompletionRequest, CompletionResponse, CompletionStreamResponse
from dspark.serve.protocol import random_id as new_id
from dspark.serve.state import ServerState, State
from dspark.serve.streaming import ClientGone, event_stream_of, merged, sse, streaming_response, usage, wait_final

router = APIRouter()


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={200: event_stream_of(CompletionStreamResponse)} | GENERATION_ERRORS,
)
async def completions(req: CompletionRequest, request: Request, state: State):
    state.check_model(req.model)
    engine = state.engine
    prompts = await state.off_loop(encode_completion_prompts, engine, req.prompt, state.config.max_prompts_per_request)
    params = _params(state, req, prompts)
    rid = new_id("cmpl")
    kv = req.kv_transfer_params
    if kv is not None and kv.do_remote_decode:  # P/D prefill: the first token here, the rest on a decode instance
        lens = [len(p) for p in prompts]
        return await prefill_for_remote_decode(
            state, request, kv, prompts, params, rid, lambda out: _response(state, req, rid, [out], lens)
        )
    streams = await open_streams(state, prompts, params, rid, kv)  # P/D decode: continued from a shipped state
    if req.stream:
        return streaming_response(_events(state, req, rid, streams, params), streams)
    try:
        finals = await wait_final(streams, request)
    except ClientGone:
        return Response(status_code=499)
    return _response(state, req, rid, finals, [len(p) for p in prompts])


def _params(state: ServerState, req: CompletionRequest, prompts: list[list[int]]) -> list[SamplingParams]:
    """One per prompt: with max_tokens null, prompts of different lengths get different budgets."""
    limit = state.engine.max_model_len
    outs_max = [req.max_tokens if req.max_tokens is not None else max(1, limit - len(p)) for p in prompts]
    for p, m in zip(prompts, outs_max):
        check_length(state.engine, len(p), m, "prompt")
    return [sampling_params_of(req, m) for m in outs_max]


def _response(
    state: ServerState, req: CompletionRequest, rid: str, finals: list[RequestOutput], prompt_lens: list[int]
) -> CompletionResponse:
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
    metrics = state.response_metrics(finals[0]) if len(finals) == 1 else None
    return CompletionResponse(
        id=rid, model=state.model_name, choices=choices, usage=usage(finals, prompt_lens), metrics=metrics
    )


async def _events(
    state: ServerState, req: CompletionRequest, rid: str, streams: list[RequestStream], params: list[SamplingParams]
) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
    texts = [IncrementalText(p.stop) for p in params]
    last: list[RequestOutput | None] = [None] * len(streams)
    lens = [s.num_prompt_tokens for s in streams]
    single = len(streams) == 1
    async for i, out in merged(streams):
        last[i] = out
        delta = texts[i].update(out.text, out.finished)
        if not delta and not out.finished:
            continue
        done = out.finished
        choice = CompletionChoice(
            index=i,
            text=delta,
            finish_reason=out.finish_reason if done else None,
            stop_reason=out.stop_reason if done else None,
        )
        chunk = CompletionStreamResponse(id=rid, model=state.model_name, choices=[choice])
        chunk.usage = usage([out], [lens[i]]) if continuous else None
        chunk.metrics = state.response_metrics(out) if done and single else None
        yield sse(chunk)
    if include_usage:
        final = CompletionStreamResponse(id=rid, model=state.model_name, choices=[], usage=usage(last, lens))
        final.metrics = state.response_metrics(last[0]) if single else None
        yield sse(final)
