"""OpenAI-compatible request/response models (pydantic; the only pydantic in dspark).

Requests ignore unknown fields (as vLLM does) and use strict types (as vLLM does): ``"max_tokens": true`` or
``"stream": "yes"`` are 400s, not coerced. An integer field takes any integral JSON number (``2.0`` is ``2``, as
JSON Schema's "integer" says; ``2.5`` is a 400). Text must be valid Unicode (a lone surrogate such as ``"\ud800"`` is a
400 naming the field). Every field a request may carry is applied or refused: the fields dspark cannot honour
(``best_of > 1``, ``suffix``) are declared so that a value other than their neutral one is rejected with a clear
400 instead of being silently dropped; the structured-output models refuse keys they do not know.

The models are the server's contract: ``/openapi.json`` is generated from them, so every rule a request must
meet that does not depend on the model being served is declared here (ranges, non-empty prompts, the supported
values of the unsupported fields) and appears in the JSON Schema. What depends on the served model (its context
length, vocabulary and chat template) or on the server's flags is checked by the routes, whose 400s then carry
one of ``DEPLOYMENT_LIMIT_CODES``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError, core_schema

from dspark.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
CHAT_DEFAULT_MAX_TOKENS = 256  # chat default, capped by what the context has left after the prompt
EMPTY_PROMPT = "prompt is empty; give a non-empty string or a non-empty list of token ids"

# error codes of the 400s a request valid by the schema can still get: limits of the served model or of the
# server's flags, which the schema cannot state (the conformance test allows exactly these)
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt + max_tokens over the model's context length
TOKEN_ID_OUT_OF_RANGE = "token_id_out_of_range"  # a token id not in the model's vocabulary
TOO_MANY_PROMPTS = "too_many_prompts"  # more prompts in one request than --max-prompts-per-request
CHAT_TEMPLATE_ERROR = "chat_template_error"  # the model has no chat template or its template refuses the chat
# the grammar engine cannot compile the schema / regex / grammar, or two fields constrain the output
STRUCTURED_OUTPUT_UNSUPPORTED = "structured_output_unsupported"
DEPLOYMENT_LIMIT_CODES = frozenset(
    {
        CONTEXT_LENGTH_EXCEEDED,
        TOKEN_ID_OUT_OF_RANGE,
        TOO_MANY_PROMPTS,
        CHAT_TEMPLATE_ERROR,
        STRUCTURED_OUTPUT_UNSUPPORTED,
    }
)
# markers in the generated JSON Schema that serve/openapi.py replaces with the served model's limits
TOKEN_ID_MARK = "x-dspark-token-id"  # an integer token id: maximum vocab - 1
PROMPT_IDS_MARK = "x-dspark-prompt-ids"  # a prompt as token ids: maxItems max_model_len - 1
MAX_TOKENS_MARK = "x-dspark-max-tokens"  # generated tokens: maximum max_model_len - 1
ROLE_MARK = "x-dspark-role"  # a chat message's role: the roles the chat template renders


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


# ---- rules on whole fields -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """A check on a whole field with the JSON Schema keywords that say the same thing.

    ``check(value, field_name)`` returns the problem (None when the value is fine): the 400 names the field
    itself (``prompt``, not ``prompt.1``) with that message. ``declare(schema)`` adds the rule to the field's
    generated JSON Schema, so /openapi.json states what the validator enforces."""

    check: Callable[[Any, str], str | None]
    declare: Callable[[dict[str, Any]], None]

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        def validate(value: Any, info: core_schema.ValidationInfo) -> Any:
            problem = self.check(value, info.field_name or "body")
            if problem is not None:
                raise PydanticCustomError("value_error", "{problem}", {"problem": problem})
            return value

        return core_schema.with_info_after_validator_function(validate, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: Any) -> dict[str, Any]:
        js = handler(schema)
        self.declare(js)
        return js


def subschemas(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The schema and every schema nested in it through anyOf / oneOf / allOf / items (not through $ref)."""
    out = [schema]
    for key in ("anyOf", "oneOf", "allOf"):
        for s in schema.get(key, []):
            out += subschemas(s)
    if isinstance(schema.get("items"), dict):
        out += subschemas(schema["items"])
    return out


def _declare_non_empty_ids(schema: dict[str, Any]) -> None:
    for s in subschemas(schema):
        kind = s.get("type")
        if kind == "string":
            s["minLength"] = 1
        elif kind == "array":
            s["minItems"] = 1
            if s.get("items", {}).get("type") == "integer":
                s[PROMPT_IDS_MARK] = True
        elif kind == "integer":
            s["minimum"], s[TOKEN_ID_MARK] = 0, True


def _declare_ids(schema: dict[str, Any]) -> None:
    for s in subschemas(schema):
        if s.get("type") == "integer":
            s["minimum"], s[TOKEN_ID_MARK] = 0, True


def _negative_id(ids: list[Any]) -> str | None:
    bad = [t for t in ids if isinstance(t, int) and t < 0]
    return f"token id {bad[0]} is negative: token ids are integers from 0" if bad else None


def _prompt_problem(prompt: Any, _: str) -> str | None:
    if isinstance(prompt, str):
        return EMPTY_PROMPT if not prompt else None
    if not prompt:
        return EMPTY_PROMPT
    batch = [prompt] if all(isinstance(x, int) for x in prompt) else prompt
    for p in batch:
        problem = EMPTY_PROMPT if len(p) == 0 else _negative_id(p) if isinstance(p, list) else None
        if problem is not None:
            return problem
    return None


def only(*allowed: Any, hint: str) -> Rule:
    """The field is declared so that other values get a clear 400 (``hint`` says what to do) instead of being
    ignored; the schema lists the supported values."""

    def check(value: Any, field: str) -> str | None:
        return None if value in allowed else f"{field}={json.dumps(value)} is not supported: {hint}"

    def declare(schema: dict[str, Any]) -> None:
        schema["enum"] = list(allowed)

    return Rule(check, declare)


def _text_parts_only(content: Any, _: str) -> str | None:
    bad = [p.type for p in content if p.type != "text"] if isinstance(content, list) else []
    return f"only 'text' parts are supported (got {bad[0]!r})" if bad else None


def _declare_text_parts(schema: dict[str, Any]) -> None:
    for s in subschemas(schema):
        if s.get("type") == "array" and "items" in s:
            s["items"] = {"allOf": [s["items"], {"properties": {"type": {"const": "text"}}}]}


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


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


Text = Annotated[str, AfterValidator(_valid_unicode)]
# strict, but 2.0 is 2 (JSON Schema's integer); put after a Field's bounds so the schema keeps them
Integral = BeforeValidator(_integral)
Int = Annotated[int, Integral]
TokenIds = Annotated[list[Int], Rule(lambda ids, _: _negative_id(ids), _declare_ids)]
# the upper bound is the served model's context (MAX_TOKENS_MARK; with the prompt: CONTEXT_LENGTH_EXCEEDED)
MaxTokens = Annotated[int, Field(ge=1, json_schema_extra={MAX_TOKENS_MARK: True}), Integral]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


def example(**body: Any) -> ConfigDict:
    """A request model's example body (in /openapi.json; Schemathesis sends it first)."""
    return ConfigDict(json_schema_extra={"examples": [body]})


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class KVTransferParams(_Request):
    """vLLM's ``kv_transfer_params``, set by the P/D proxy (``dspark serve-proxy``), not by clients: a prefill
    instance gets ``do_remote_decode`` (run the prompt, push its state to ``decode_url``), a decode instance
    ``do_remote_prefill`` (continue from the pushed state ``transfer_id``, else prefill locally)."""

    transfer_id: Annotated[Text, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    decode_url: Annotated[Text, Field(pattern=r"^https?://")] | None = None


class JsonSchemaFormat(_Request):
    """``response_format.json_schema`` (OpenAI): the schema the output follows (``strict`` is always honoured)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: Text | None = None
    description: Text | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")]
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (with ``json_schema``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a JSON schema), ``json_object``, ``regex``,
    ``choice`` or ``grammar`` (Lark, or GBNF / EBNF). Other keys are refused by name."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: Annotated[dict[str, Any] | Text | None, Field(alias="json")] = None
    json_object: bool | None = None
    regex: Annotated[Text, Field(min_length=1)] | None = None
    choice: Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: Annotated[Text, Field(min_length=1)] | None = None


TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,18}$")]  # a logit_bias key: a token id as a decimal string
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), Integral]


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names, plus vLLM's top_k/ignore_eos).
    The ranges are ``SamplingParams``'s."""

    model: Text | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX), Integral] | None = None  # -1 or 0: off
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), Integral] | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX), Integral]] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM extension: token_ids / prompt_token_ids on non-streaming choices
    n: Annotated[int, Field(ge=1, le=INT64_MAX), Integral] = 1  # independent samples (prompts x n: TOO_MANY_PROMPTS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # logits processing (SamplingParams): the distribution sampled and verified against, exact under speculation
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = None
    presence_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX), Integral] | None = None  # EOS / stop ids held back
    # structured outputs (at most one of these; serve/inputs.py): a grammar masks the same distribution
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | Text | None = None  # vLLM's older names of structured_outputs' keys
    guided_regex: Annotated[Text, Field(min_length=1)] | None = None
    guided_choice: Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1)] | None = None
    guided_grammar: Annotated[Text, Field(min_length=1)] | None = None
    # between dspark instances (the P/D proxy sets it), so not in /openapi.json's public contract
    kv_transfer_params: SkipJsonSchema[KVTransferParams | None] = None


CompletionPrompt = Text | list[Text] | list[Int] | list[list[Int]]


class CompletionRequest(_SamplingFields):
    model_config = example(prompt="The capital of France is", max_tokens=8)

    prompt: Annotated[CompletionPrompt, Rule(_prompt_problem, _declare_non_empty_ids)]
    # 0: no generated token (with echo and logprobs: the prompt's log-likelihoods from one prefill)
    max_tokens: Annotated[int, Field(ge=0, json_schema_extra={MAX_TOKENS_MARK: True}), Integral] | None = (
        COMPLETIONS_DEFAULT_MAX_TOKENS
    )
    logprobs: TopLogprobs | None = None  # per token: its logprob and the top-k alternatives'
    echo: bool = False  # the prompt before the completion (and its tokens' logprobs, the first null)
    best_of: Annotated[Int | None, only(None, 1, hint="only 1")] = None
    suffix: Annotated[Text | None, only(None, "", hint="omit 'suffix'")] = None


class TextPart(_Request):
    type: Text
    text: Text | None = None


class ChatMessage(_Request):
    # /openapi.json lists the roles the served model's chat template renders (serve/openapi.py); system and developer
    # messages a template refuses are folded into the first user turn (serve/inputs.py: render_chat)
    role: Annotated[
        Literal["system", "user", "assistant", "developer", "tool"], Field(json_schema_extra={ROLE_MARK: True})
    ]
    content: Annotated[Text | list[TextPart] | None, Rule(_text_parts_only, _declare_text_parts)] = None
    name: Text | None = None


Messages = Annotated[list[ChatMessage], Field(min_length=1)]


class ChatCompletionRequest(_SamplingFields):
    model_config = example(messages=[{"role": "user", "content": "Hello!"}], max_tokens=8)

    messages: Messages
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None  # alternatives per token; > 0 returns logprobs even without 'logprobs'


class TokenizeCompletionRequest(_Request):
    """POST /tokenize of a prompt (special tokens added, as /v1/completions does)."""

    model_config = example(prompt="Hello!")

    model: Text | None = None
    prompt: Text
    messages: None = None  # the other kind: a body with both is refused
    add_special_tokens: bool = True


class TokenizeChatRequest(_Request):
    """POST /tokenize of a chat, as /v1/chat/completions renders it (the template places special tokens)."""

    model_config = example(messages=[{"role": "user", "content": "Hello!"}])

    model: Text | None = None
    messages: Messages
    prompt: None = None
    add_special_tokens: bool = False


TOKENIZE_KINDS = "give exactly one of 'prompt' (a string) or 'messages' (a chat)"


def _tokenize_kind(body: Any) -> str | None:
    """The branch of a /tokenize body; None (a 400 saying TOKENIZE_KINDS) for both or neither. The tags hold
    '[' so that error locations drop them, as they drop pydantic's own union tags."""
    if isinstance(body, TokenizeCompletionRequest | TokenizeChatRequest):
        return "tokenize[chat]" if isinstance(body, TokenizeChatRequest) else "tokenize[prompt]"
    if not isinstance(body, dict):
        return "tokenize[prompt]"  # not an object: that branch says so
    prompt, messages = body.get("prompt") is not None, body.get("messages") is not None
    return "tokenize[prompt]" if prompt and not messages else "tokenize[chat]" if messages and not prompt else None


TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("tokenize[prompt]")]
    | Annotated[TokenizeChatRequest, Tag("tokenize[chat]")],
    Discriminator(_tokenize_kind, custom_error_type="tokenize_kind", custom_error_message=TOKENIZE_KINDS),
]


class DetokenizeRequest(_Request):
    model_config = example(tokens=[10, 11, 12])

    model: Text | None = None
    tokens: TokenIds


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


class CompletionLogprobs(BaseModel):
    """The legacy completions layout: per token its text, logprob (null for an echoed prompt's first token), the
    top alternatives by text, and its character offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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


class VersionResponse(BaseModel):
    version: str


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
