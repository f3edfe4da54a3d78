"""The OpenAI features on the bundled models themselves, through the ``openai`` client: the default pair
(kimi-k3-mini, bf16 where the CPU has it) and SmolLM2 (its GGUF in the int8 arithmetic), each served with and without
DSpark. At T=0 the speculative server answers exactly what the plain one does: the same tokens, the same logprobs
(top-k included, streamed or not), the same prompt log-likelihoods; a +100 logit_bias makes its token the first
generated; n samples come back; a json_object answer parses and a json_schema answer validates. The tiny-pair
suites (test_serve_sampling.py, test_structured_outputs.py) test each rule in depth; this one checks that the real
models' paths are wired to them."""

from __future__ import annotations

import json

import openai
import pytest

from dspark.config import ConfigError
from dspark.llm import build_engine
from serve_helpers import serving

MODELS = ["kimi-k3-mini", "smollm2-135m-instruct"]
SPEC = {"method": "dspark", "num_speculative_tokens": 3, "speculation_guard": False}  # every step drafts


@pytest.fixture(scope="module", params=MODELS)
def servers(request):
    from dspark.checkpoint.resolve import resolve_model_ref

    try:
        resolve_model_ref(request.param)
    except ConfigError as e:  # SmolLM2 comes with the smollm2 extra
        pytest.skip(str(e))
    plain = build_engine(request.param, None, max_model_len=256, max_num_seqs=4)
    spec = build_engine(request.param, SPEC, max_model_len=256, max_num_seqs=4)
    with serving(plain) as plain_url, serving(spec) as spec_url:
        name = client(plain_url).models.list().data[0].id  # the served name
        yield {"plain": (plain_url, plain), "spec": (spec_url, spec), "model": name}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


CHAT = [{"role": "user", "content": "Write a Python function that reverses a list."}]


def _chat_logprobs(url: str, model: str, stream: bool) -> tuple[list[str], list[float], list[list[str]]]:
    kw = {"model": model, "messages": CHAT, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    if not stream:
        entries = client(url).chat.completions.create(**kw).choices[0].logprobs.content
    else:
        entries = []
        for chunk in client(url).chat.completions.create(stream=True, **kw):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                entries += chunk.choices[0].logprobs.content
    top = [[t.token for t in e.top_logprobs] for e in entries]
    return [e.token for e in entries], [e.logprob for e in entries], top


def test_chat_logprobs_streamed_or_not_equal_plain_decoding(servers):
    plain_tokens, plain_lp, plain_top = _chat_logprobs(servers["plain"][0], servers["model"], stream=False)
    assert len(plain_tokens) == 12 and all(len(t) == 3 for t in plain_top)
    for stream in (False, True):
        tokens, lp, top = _chat_logprobs(servers["spec"][0], servers["model"], stream)
        assert tokens == plain_tokens and top == plain_top
        assert lp == pytest.approx(plain_lp, abs=1e-4)  # the verification's logits: the same rows, equal to ~1e-6
    assert servers["spec"][1].metrics.spec.num_drafts > 0


def test_echo_returns_the_prompts_log_likelihoods_in_one_prefill(servers):
    got = {}
    for name in ("plain", "spec"):
        url, model = servers[name][0], servers["model"]
        out = client(url).completions.create(model=model, prompt="def add(a, b):", max_tokens=0, echo=True, logprobs=1)
        lp = out.choices[0].logprobs
        assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
        got[name] = lp.token_logprobs[1:]
    assert got["spec"] == pytest.approx(got["plain"], abs=1e-4)


def test_logit_bias_n_and_json_object(servers):
    (url, engine), model = servers["spec"], servers["model"]
    token = engine.tokenizer.encode("Hello", False)[0]
    biased = client(url).completions.create(
        model=model, prompt="1 2 3", max_tokens=2, logit_bias={str(token): 100}, extra_body={"return_token_ids": True}
    )
    assert biased.choices[0].token_ids[0] == token
    samples = client(url).completions.create(model=model, prompt="Once", max_tokens=4, n=2, temperature=1, seed=3)
    assert len(samples.choices) == 2 and {c.index for c in samples.choices} == {0, 1}
    answer = client(url).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give a JSON object with a key 'a'."}],
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_object"},
        presence_penalty=0.2,
    )
    choice = answer.choices[0]
    if choice.finish_reason == "stop":  # a complete object; a cut one ("length") can only be a JSON prefix
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.lstrip().startswith("{")
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    typed = client(url).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is 2+2 four? Answer as JSON."}],
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    assert typed.choices[0].finish_reason == "stop", typed.choices[0].message.content
    got = json.loads(typed.choices[0].message.content)
    assert set(got) == {"ok", "n"} and isinstance(got["ok"], bool) and got["n"] in range(10)
