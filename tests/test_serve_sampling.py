"""The server's logprobs, echo (prompt log-likelihoods), n, logit_bias / penalties / min_tokens, through the
``openai`` client and SSE, with and without speculation; and the rule that every request field is applied or
refused by name."""

from __future__ import annotations

import httpx
import openai
import pytest

from dspark.llm import LLM
from dspark.models.tiny import write_tiny_pair
from dspark.sampling_params import SamplingParams
from dspark.serve.protocol import ChatCompletionRequest, CompletionRequest
from serve_helpers import make_engine, serving, sse_events

TOL = 1e-5  # fp32: a verification forward's GEMM shapes differ from a one-row decode's (tokens are identical)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def servers(pair):
    plain, spec = make_engine(pair, spec=False), make_engine(pair)
    with serving(plain) as plain_url, serving(spec) as spec_url:
        yield {"plain": (plain_url, plain), "spec": (spec_url, spec)}


@pytest.fixture(scope="module")
def offline(pair):
    """The LLM API on an engine of its own (a served engine belongs to its server's engine thread)."""
    return LLM.from_engine(make_engine(pair, spec=False))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _close(a: list[float | None], b: list[float | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None) == (y is None) and (x is None or abs(x - y) <= TOL) for x, y in zip(a, b)
    )


GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


def test_completion_logprobs_are_equal_with_and_without_speculation(servers):
    outs = {}
    for name, (url, _) in servers.items():
        r = client(url).completions.create(model="target", prompt="the cat sat", logprobs=3, extra_body=GREEDY)
        outs[name] = r.choices[0]
    a, b = outs["plain"], outs["spec"]
    assert a.text == b.text and a.logprobs.tokens == b.logprobs.tokens and len(a.logprobs.tokens) == 12
    assert _close(a.logprobs.token_logprobs, b.logprobs.token_logprobs)
    for lp, top in zip(a.logprobs.token_logprobs, a.logprobs.top_logprobs):
        assert lp == max(top.values()) and 1 <= len(top) <= 4  # greedy: the token is the most likely
    assert a.logprobs.text_offset[0] == 0 and a.logprobs.text_offset == sorted(a.logprobs.text_offset)


def test_echo_with_max_tokens_0_returns_the_prompts_log_likelihoods(servers, offline):
    """lm-evaluation-harness's loglikelihood request: one prefill, no decoding; the values are the LLM API's."""
    for url, engine in servers.values():
        body = {"model": "target", "prompt": "Paris is in France", "echo": True, "max_tokens": 0, "logprobs": 1}
        choice = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
        lp = choice["logprobs"]
        ids = engine.tokenizer.encode(body["prompt"])
        assert choice["text"] == body["prompt"] and choice["finish_reason"] == "length"
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and len(lp["tokens"]) == len(ids)
        (ref,) = offline.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))
        assert _close(lp["token_logprobs"], [None] + [e.logprob for e in ref.prompt_logprobs[1:]])
    url = servers["spec"][0]
    r = client(url).completions.create(model="target", prompt="ab", echo=True, logprobs=0, extra_body=GREEDY)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("ab") and len(lp.tokens) == len(servers["spec"][1].tokenizer.encode("ab")) + 12


def _stream_completion(url: str, body: dict) -> tuple[str, list]:
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60) as r:
        chunks = [e for e in sse_events(r.iter_lines()) if isinstance(e, dict) and e.get("choices")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    lps = [x for c in chunks if c["choices"][0]["logprobs"] for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    return text, lps


def test_streamed_logprobs_add_up_to_the_response(servers):
    url = servers["spec"][0]
    body = {"model": "target", "prompt": "once upon", "logprobs": 2, "echo": True} | GREEDY
    whole = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
    text, lps = _stream_completion(url, body)
    assert text == whole["text"] and lps == whole["logprobs"]["token_logprobs"]
    chat = {"model": "target", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    whole = httpx.post(f"{url}/v1/chat/completions", json=chat | GREEDY).json()["choices"][0]
    content = whole["logprobs"]["content"]
    assert len(content) == 12 and all(len(c["top_logprobs"]) == 2 and c["bytes"] is not None for c in content)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat | GREEDY | {"stream": True}) as r:
        events = [e for e in sse_events(r.iter_lines()) if isinstance(e, dict) and e.get("choices")]
    streamed = [c for e in events if e["choices"][0]["logprobs"] for c in e["choices"][0]["logprobs"]["content"]]
    assert streamed == content


def test_n_samples_are_independent_and_reproducible(servers):
    url = servers["spec"][0]
    body = {"model": "target", "prompt": ["x", "yz"], "n": 3, "temperature": 1.0, "seed": 5, "max_tokens": 8}
    a = httpx.post(f"{url}/v1/completions", json=body | {"ignore_eos": True}).json()
    b = httpx.post(f"{url}/v1/completions", json=body | {"ignore_eos": True}).json()
    assert [c["index"] for c in a["choices"]] == list(range(6)) and a["choices"] == b["choices"]
    assert len({c["text"] for c in a["choices"][:3]}) > 1  # own seed streams
    assert a["usage"]["completion_tokens"] == 6 * 8
    r = client(url).chat.completions.create(
        model="target",
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        seed=1,
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 12
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as s:
        indexes = {c["index"] for e in sse_events(s.iter_lines()) if isinstance(e, dict) for c in e.get("choices", [])}
    assert indexes == set(range(6))
    too_many = httpx.post(f"{url}/v1/completions", json=body | {"n": 10**6}).json()["error"]
    assert too_many["param"] == "n" and too_many["code"] == "too_many_prompts"


def test_logit_bias_and_penalties_are_applied_exactly(servers, offline):
    url, engine = servers["spec"]
    token = 40
    forced = {"model": "target", "prompt": "abc", "max_tokens": 1, "logit_bias": {str(token): 100}, "temperature": 1}
    ids = httpx.post(f"{url}/v1/completions", json=forced | {"return_token_ids": True}).json()["choices"][0]
    assert ids["token_ids"] == [token]
    chat = client(url).chat.completions.create(
        model="target",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        logit_bias={str(token): 100},
        extra_body={"return_token_ids": True},
    )
    assert chat.choices[0].token_ids == [token]
    penal = {"presence_penalty": 0.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3, "min_tokens": 3}
    got = {}
    for name, (u, _) in servers.items():
        body = {"model": "target", "prompt": "aaaa", "return_token_ids": True} | GREEDY | penal
        got[name] = httpx.post(f"{u}/v1/completions", json=body).json()["choices"][0]["token_ids"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **penal)
    (ref,) = offline.generate(["aaaa"], params)
    assert got["plain"] == got["spec"] == ref.token_ids, (got, ref.token_ids)
    out_of_vocab = httpx.post(f"{url}/v1/completions", json=forced | {"logit_bias": {"999999": 1}}).json()["error"]
    assert out_of_vocab["param"] == "logit_bias" and out_of_vocab["code"] == "token_id_out_of_range"


# every request field: applied (the engine uses it) or refused with a 400 naming it (never silently ignored)
APPLIED = {
    "model", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "return_token_ids", "n",
    "stream", "stream_options", "user", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_tokens", "kv_transfer_params", "prompt", "max_tokens", "logprobs", "echo", "messages",
    "max_completion_tokens", "top_logprobs", "response_format", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar",
}  # fmt: skip
REFUSED = {"best_of": 2, "suffix": "s"}  # a non-neutral value of each


def test_every_request_field_is_applied_or_refused_by_name(servers):
    url = servers["spec"][0]
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert fields == APPLIED | REFUSED.keys(), fields ^ (APPLIED | REFUSED.keys())
    for name, value in REFUSED.items():
        path, base = "completions", {"prompt": "x", "max_tokens": 1}
        if name not in CompletionRequest.model_fields:
            path, base = "chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        r = httpx.post(f"{url}/v1/{path}", json=base | {name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
