"""POST /v1/completions: one prompt or a batch, ``n`` samples each, JSON or SSE (``stream: true``). Without
max_tokens (null) each prompt generates up to what the context leaves after it. Choice ``i * n + j`` is sample j of
prompt i. ``echo`` puts the prompt before the completion (and, with ``logprobs``, its tokens' logprobs: with
``max_tokens: 0`` the prompt's log-likelihoods from one prefill)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from dspark.engine.engine import RequestOutput
from dspark.sampling_params import SamplingParams
from dspark.serve.async_engine import IncrementalText, RequestStream
from dspark.serve.disagg import open_streams, prefill_for_remote_decode
from dspark.serve.errors import GENERATION_ERRORS
from dspark.serve.inputs import check_length, completion_prompts, encode_completion_prompts, sampling_params_of
from dspark.serve.logprobs import completion_logprobs
from dspark.serve.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
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
    limit = state.config.max_prompts_per_request
    prompts = await state.off_loop(encode_completion_prompts, engine, req.prompt, limit, req.n)
    params = await state.off_loop(_params, state, req, prompts)  # a grammar compiles here
    rid = new_id("cmpl")
    kv = req.kv_transfer_params
    lens = [len(p) for p in prompts]
    echo = _echo_texts(state, req, prompts)
    if kv is not None and kv.do_remote_decode:  # P/D prefill: the first token here, the rest on a decode instance
        return await prefill_for_remote_decode(
            state, request, kv, prompts, params, rid, lambda out: _response(state, req, rid, [out], lens, echo)
        )
    samples = [(i, s) for i, p in enumerate(params) for s in p.samples()]  # choice i * n + j
    echo = [echo[i] for i, _ in samples]
    # P/D decode: continued from a shipped state
    streams = await open_streams(state, [prompts[i] for i, _ in samples], [s for _, s in samples], rid, kv)
    if req.stream:
        choices = [_ChoiceStream(s, e) for (_, s), e in zip(samples, echo)]
        return streaming_response(_events(state, req, rid, streams, choices, lens), streams)
    try:
        finals = await wait_final(streams, request)
    except ClientGone:
        return Response(status_code=499)
    return _response(state, req, rid, finals, lens, echo)


def _params(state: ServerState, req: CompletionRequest, prompts: list[list[int]]) -> list[SamplingParams]:
    """One per prompt: with max_tokens null, prompts of different lengths get different budgets."""
    limit = state.engine.max_model_len
    outs_max = [req.max_tokens if req.max_tokens is not None else max(1, limit - len(p)) for p in prompts]
    for p, m in zip(prompts, outs_max):
        check_length(state.engine, len(p), m, "prompt")
    return [sampling_params_of(state.engine, req, m) for m in outs_max]


def _echo_texts(state: ServerState, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """Per prompt, what ``echo`` puts before its completions: the prompt as sent (token ids: their decoded text);
    '' without echo."""
    if not req.echo:
        return [""] * len(prompts)
    sent = completion_prompts(req.prompt)
    return [p if isinstance(p, str) else state.engine.tokenizer.decode(ids) for p, ids in zip(sent, prompts)]


def _logprobs(
    state: ServerState, req: CompletionRequest, out: RequestOutput, first: int, offset: int, echo: bool
) -> CompletionLogprobs | None:
    """Logprobs of the sample's tokens from ``first`` on, after the prompt's when ``echo`` (the first chunk or the
    whole response of an echo request); ``offset``: the first token's character offset."""
    if req.logprobs is None:
        return None
    sample = out.outputs[0]
    ids, entries = list(sample.token_ids[first:]), list((sample.logprobs or [])[first:])
    if echo and out.prompt_logprobs is not None:
        ids, entries = out.prompt_token_ids + ids, list(out.prompt_logprobs) + entries
    return completion_logprobs(state.engine.tokenizer, ids, entries, offset)


def _response(
    state: ServerState,
    req: CompletionRequest,
    rid: str,
    finals: list[RequestOutput],
    prompt_lens: list[int],
    echo: list[str],
) -> CompletionResponse:
    ids = req.return_token_ids
    choices = []
    for i, o in enumerate(finals):
        choices.append(
            CompletionChoice(
                index=i,
                text=echo[i] + o.text,
                logprobs=_logprobs(state, req, o, 0, 0, req.echo),
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
                token_ids=o.token_ids if ids else None,
                prompt_token_ids=o.prompt_token_ids if ids else None,
            )
        )
    metrics = state.response_metrics(finals[0]) if len(finals) == 1 else None
    return CompletionResponse(
        id=rid, model=state.model_name, choices=choices, usage=usage(finals, prompt_lens), metrics=metrics
    )


class _ChoiceStream:
    """What one choice has streamed: its text (stop strings held back), tokens with logprobs, and echo."""

    def __init__(self, params: SamplingParams, echo: str) -> None:
        self.text = IncrementalText(params.stop)
        self.echo = echo  # sent with the first chunk
        self.tokens = 0  # tokens whose logprobs were sent
        self.offset = 0  # characters sent
        self.started = False

    def chunk(
        self, state: ServerState, req: CompletionRequest, index: int, out: RequestOutput
    ) -> CompletionChoice | None:
        delta = self.text.update(out.text, out.finished)
        if not delta and not out.finished:
            return None
        echo = "" if self.started else self.echo
        logprobs = _logprobs(state, req, out, self.tokens, self.offset, req.echo and not self.started)
        self.started = True
        self.tokens, self.offset = len(out.token_ids), self.offset + len(echo) + len(delta)
        done = out.finished
        return CompletionChoice(
            index=index,
            text=echo + delta,
            logprobs=logprobs,
            finish_reason=out.finish_reason if done else None,
            stop_reason=out.stop_reason if done else None,
        )


async def _events(
    state: ServerState,
    req: CompletionRequest,
    rid: str,
    streams: list[RequestStream],
    choices: list[_ChoiceStream],
    prompt_lens: list[int],
) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
    last: list[RequestOutput | None] = [None] * len(streams)
    single = len(streams) == 1
    async for i, out in merged(streams):
        last[i] = out
        choice = choices[i].chunk(state, req, i, out)
        if choice is None:
            continue
        chunk = CompletionStreamResponse(id=rid, model=state.model_name, choices=[choice])
        chunk.usage = usage([out], [streams[i].num_prompt_tokens]) if continuous else None
        chunk.metrics = state.response_metrics(out) if out.finished and single else None
        yield sse(chunk)
    if include_usage:
        final = CompletionStreamResponse(id=rid, model=state.model_name, choices=[], usage=usage(last, prompt_lens))
        final.metrics = state.response_metrics(last[0]) if single else None
        yield sse(final)
