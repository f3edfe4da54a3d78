"""From a parsed request to engine inputs: prompt token ids, checked lengths and ``SamplingParams``.

Chat prompts are ``apply_chat_template(messages, add_generation_prompt=True)`` of the model's tokenizer (its Jinja
``chat_template`` from tokenizer_config.json), encoded without adding special tokens (the template places them).
The functions here are synchronous and may be slow on long text: routes run them through ``ServerState.off_loop``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from jinja2 import TemplateError

from dspark.config import ConfigError
from dspark.engine.engine import Engine, EngineError
from dspark.sampling_params import SamplingParams, SamplingParamsError, StructuredOutput
from dspark.serve.errors import APIError
from dspark.serve.protocol import (
    CHAT_TEMPLATE_ERROR,
    CONTEXT_LENGTH_EXCEEDED,
    STRUCTURED_OUTPUT_UNSUPPORTED,
    TOKEN_ID_OUT_OF_RANGE,
    TOO_MANY_PROMPTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionPrompt,
    CompletionRequest,
    ResponseFormat,
)

STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def encode_prompt(engine: Engine, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids exactly as AutoTokenizer gives them (``Engine.add_request`` of a string: special tokens added)."""
    return engine.tokenizer.encode(text, add_special_tokens)


ROLES = ("system", "user", "assistant", "developer", "tool")
FOLDED_ROLES = ("system", "developer")  # rendered into the first user turn when the template refuses them


@functools.lru_cache(maxsize=16)
def _template_roles(tokenizer: object) -> frozenset[str]:
    """The roles the chat template renders (each probed before a user turn); empty without a template."""
    ok = set()
    for role in ROLES:
        try:
            tokenizer.apply_chat_template([{"role": role, "content": "x"}, {"role": "user", "content": "x"}])
            ok.add(role)
        except (ConfigError, TemplateError):
            pass
    return frozenset(ok)


def chat_roles(engine: Engine) -> list[str]:
    """The roles a chat request may use on this model: the template's own, plus system and developer by the folding
    rule; empty when the model has no chat template (every chat is then a CHAT_TEMPLATE_ERROR)."""
    own = _template_roles(engine.tokenizer)
    return [r for r in ROLES if r in own or (own and r in FOLDED_ROLES)]


def _fold_system(turns: list[dict[str, str]], own: frozenset[str]) -> list[dict[str, str]]:
    """System / developer messages the template refuses, joined by blank lines, before the first user message's
    content (a user message of their own when there is none)."""
    folded = [t["content"] for t in turns if t["role"] in FOLDED_ROLES and t["role"] not in own]
    if not folded or not own:
        return turns
    rest = [t for t in turns if not (t["role"] in FOLDED_ROLES and t["role"] not in own)]
    first = next((i for i, t in enumerate(rest) if t["role"] == "user"), None)
    if first is None:
        return [{"role": "user", "content": "\n\n".join(folded)}, *rest]
    rest[first] = {"role": "user", "content": "\n\n".join([*folded, rest[first]["content"]])}
    return rest


def render_chat(engine: Engine, messages: Sequence[ChatMessage]) -> str:
    """The chat prompt text (the request models allow only 'text' content parts); system / developer messages the
    template refuses are folded into the first user turn."""
    turns = []
    for m in messages:
        content = "".join(p.text or "" for p in m.content) if isinstance(m.content, list) else m.content or ""
        turns.append({"role": m.role, "content": content})
    turns = _fold_system(turns, _template_roles(engine.tokenizer))
    try:
        return engine.tokenizer.apply_chat_template(turns)
    except (ConfigError, TemplateError) as e:  # no chat template, or the template refuses these messages
        raise APIError(
            400,
            f"messages: the model's chat template cannot render them ({e})",
            param="messages",
            code=CHAT_TEMPLATE_ERROR,
        ) from e


def encode_chat(engine: Engine, messages: Sequence[ChatMessage]) -> list[int]:
    return encode_prompt(engine, render_chat(engine, messages), add_special_tokens=False)  # the template's own


def completion_prompts(prompt: CompletionPrompt) -> list[str | list[int]]:
    """The prompts of a completions request: a string, token ids, or a batch of either."""
    if isinstance(prompt, str) or all(isinstance(x, int) for x in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def check_samples(num_prompts: int, n: int, max_prompts: int) -> None:
    """Prompts x n samples are engine requests: at most the server's --max-prompts-per-request."""
    if num_prompts * n > max_prompts:
        raise APIError(
            400,
            f"{num_prompts} prompt(s) x n={n} samples = {num_prompts * n} generations in one request; at most "
            f"{max_prompts} (the server's --max-prompts-per-request): split the request",
            param="prompt" if n == 1 else "n",
            code=TOO_MANY_PROMPTS,
        )


def encode_completion_prompts(
    engine: Engine, prompt: CompletionPrompt, max_prompts: int, n: int = 1
) -> list[list[int]]:
    """One token-id list per prompt of a completions request (the request model already refused empty prompts and
    negative ids); at most ``max_prompts`` generations (prompts x n)."""
    prompt = completion_prompts(prompt)
    check_samples(len(prompt), n, max_prompts)
    ids = [encode_prompt(engine, p) if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[arg-type]
    check_token_ids(engine, [t for p in ids for t in p], "prompt")
    return ids


def check_token_ids(engine: Engine, ids: Sequence[int], param: str) -> None:
    vocab = engine.target.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(
            400,
            f"token id {bad[0]} is out of range: the model's vocabulary has ids [0, {vocab})",
            param=param,
            code=TOKEN_ID_OUT_OF_RANGE,
        )


def check_length(engine: Engine, n_prompt: int, max_tokens: int, prompt_param: str) -> None:
    limit = engine.max_model_len
    if n_prompt >= limit:
        raise APIError(
            400,
            f"the prompt has {n_prompt} tokens but the model's context length is {limit} (and at least one token "
            "must be generated); shorten the prompt",
            param=prompt_param,
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    if max_tokens < 0:
        raise APIError(400, f"max_tokens={max_tokens} is invalid: it must be at least 0", param="max_tokens")
    if n_prompt + max_tokens > limit:
        raise APIError(
            400,
            f"max_tokens={max_tokens} is too large: the prompt has {n_prompt} tokens and the model's context length "
            f"is {limit}, so at most {limit - n_prompt} tokens can be generated; lower max_tokens",
            param="max_tokens",
            code=CONTEXT_LENGTH_EXCEEDED,
        )


def _logprobs_of(req: CompletionRequest | ChatCompletionRequest) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs) of SamplingParams: completions' ``logprobs`` (and with ``echo`` the prompt's);
    chat's ``top_logprobs`` when ``logprobs`` is true or ``top_logprobs`` > 0."""
    if isinstance(req, CompletionRequest):
        return req.logprobs, req.logprobs if req.echo else None
    top = req.top_logprobs or 0
    return (top if req.logprobs or top else None), None


def _response_format(rf: ResponseFormat) -> StructuredOutput | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput(json_object=True)
    if rf.json_schema is None:
        raise SamplingParamsError("type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}")
    return StructuredOutput(json=rf.json_schema.schema_)


def _structured_field(req: CompletionRequest | ChatCompletionRequest, name: str) -> StructuredOutput | None:
    value = getattr(req, name)
    if value is None:
        return None
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        given = {k: v for k, v in value.model_dump(by_alias=True).items() if v not in (None, False)}
        return StructuredOutput(**given) if given else None
    key = name.removeprefix("guided_")
    return StructuredOutput(**{key: tuple(value) if key == "choice" else value})


def structured_of(engine: Engine, req: CompletionRequest | ChatCompletionRequest) -> StructuredOutput | None:
    """The request's output constraint: at most one of STRUCTURED_FIELDS, compiled once here so that a schema,
    regex or grammar the engine cannot use is a 400 naming its field."""
    found: list[tuple[str, StructuredOutput]] = []
    for name in STRUCTURED_FIELDS:
        try:
            so = _structured_field(req, name)
        except SamplingParamsError as e:
            raise APIError(400, f"{name}: {e}", param=name, code=STRUCTURED_OUTPUT_UNSUPPORTED) from None
        if so is not None:
            found.append((name, so))
    if len(found) > 1:
        raise APIError(
            400,
            f"{found[1][0]} and {found[0][0]} both constrain the output; give one of them",
            param=found[1][0],
            code=STRUCTURED_OUTPUT_UNSUPPORTED,
        )
    if not found:
        return None
    name, so = found[0]
    try:
        engine.grammar_matcher(SamplingParams(structured=so))
    except EngineError as e:
        raise APIError(400, f"{name}: {e}", param=name, code=STRUCTURED_OUTPUT_UNSUPPORTED) from None
    return so


def sampling_params_of(
    engine: Engine, req: CompletionRequest | ChatCompletionRequest, max_tokens: int
) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    bias = {int(t): b for t, b in (req.logit_bias or {}).items()}
    check_token_ids(engine, list(bias), "logit_bias")
    logprobs, prompt_logprobs = _logprobs_of(req)
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
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=bias,
        min_tokens=req.min_tokens or 0,
        structured=structured_of(engine, req),
    )
