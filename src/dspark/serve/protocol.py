"""OpenAI-compatible request/response models (pydantic; the only pydantic in dspark).

Requests ignore unknown fields (as vLLM does) and use strict types (as vLLM does): ``"max_tokens": true`` or
``"stream": "yes"`` are 400s, not coerced. Text must be valid Unicode (a lone surrogate such as ``"\ud800"`` is a
400 naming the field). The fields dspark cannot honour (``logprobs``, ``echo``, ``n > 1``, ``best_of > 1``) are
declared so they can be rejected with a clear 400 instead of being silently dropped.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
CHAT_DEFAULT_MAX_TOKENS = 256  # chat default, capped by what the context has left after the prompt


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


# ---- errors ----------------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- requests ----------------------------------------------------------------------------------------------


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start : e.end].encode("unicode_escape").decode()
        raise ValueError(
            f"the text holds a lone surrogate ({bad}) at index {e.start}: send valid Unicode "
            "(a surrogate pair or the character itself)"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names, plus vLLM's top_k/ignore_eos)."""

    model: Text | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM extension: token_ids / prompt_token_ids on non-streaming choices
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None


CompletionPrompt = Text | list[Text] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: CompletionPrompt
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: Text | None = None


class TextPart(_Request):
    type: Text
    text: Text | None = None


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(_Request):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model: Text | None = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------------------------


class SpeculativeDecodingMetrics(BaseModel):
    """Per-request speculative counters, vLLM's ``metrics.speculative_decoding`` layout.

    ``acceptance_histogram[i]`` = verification steps that accepted exactly i drafts (length K + 1);
    ``mean_acceptance_length`` = 1 + accepted / drafts (counts the bonus token)."""

    mean_acceptance_length: float | None
    draft_acceptance_rate: float | None
    num_spec_steps: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    num_spec_tokens: int
    acceptance_histogram: list[int]
    accepted_per_position: list[int]


class ResponseMetrics(BaseModel):
    speculative_decoding: SpeculativeDecodingMetrics | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    metrics: ResponseMetrics | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    metrics: ResponseMetrics | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    metrics: ResponseMetrics | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    metrics: ResponseMetrics | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "dspark"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def spec_metrics_of(spec: dict[str, Any], num_spec_tokens: int) -> SpeculativeDecodingMetrics | None:
    """Build the per-request block from ``RequestOutput.spec_metrics`` (None without speculation)."""
    drafts = int(spec.get("num_drafts") or 0)
    if num_spec_tokens <= 0:
        return None
    per_pos = list(spec.get("accepted_per_pos") or [])
    draft_tokens = int(spec.get("num_draft_tokens") or 0)
    accepted = int(spec.get("num_accepted_tokens") or 0)
    # steps accepting >= i drafts: drafts for i = 0, accepted_per_pos[i-1] for i >= 1
    at_least = [drafts] + [per_pos[i] if i < len(per_pos) else 0 for i in range(num_spec_tokens)] + [0]
    hist = [at_least[i] - at_least[i + 1] for i in range(num_spec_tokens + 1)]
    return SpeculativeDecodingMetrics(
        mean_acceptance_length=1.0 + accepted / drafts if drafts else None,
        draft_acceptance_rate=accepted / draft_tokens if draft_tokens else None,
        num_spec_steps=drafts,
        num_draft_tokens=draft_tokens,
        num_accepted_draft_tokens=accepted,
        num_spec_tokens=num_spec_tokens,
        acceptance_histogram=hist,
        accepted_per_position=per_pos + [0] * (num_spec_tokens - len(per_pos)),
    )
