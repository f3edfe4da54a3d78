"""The OpenAI-compatible server against a live uvicorn on 127.0.0.1 with a tiny random target+drafter pair:
the official ``openai`` client, greedy HTTP == offline ``LLM.generate``, SSE streaming, 32 concurrent streams,
abort on disconnect frees cache pages, 4xx for bad input, API key, 503 on a full queue, /metrics deltas."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dspark.llm import LLM
from dspark.models.tiny import write_tiny_pair
from dspark.sampling_params import SamplingParams
from dspark.serve.async_engine import IncrementalText
from dspark.serve.inputs import encode_prompt
from dspark.serve.protocol import spec_metrics_of
from serve_helpers import K, StepGate, make_engine, serving, sse_events, wait_for, wait_idle


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def spec_server(pair):
    engine = make_engine(pair, max_num_seqs=8)
    with serving(engine) as url:
        yield url, engine


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def scrape(url: str, **headers) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", headers=headers).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


# ---- pure helpers ------------------------------------------------------------------------------------------


def test_incremental_text_holds_back_partial_characters_and_stop_prefixes():
    inc = IncrementalText(stop=["XYZ"])
    snapshots = [("ab", False), ("ab\ufffd", False), ("ab€", False), ("ab€X", False), ("ab€XY", False)]
    deltas = [inc.update(t, f) for t, f in snapshots]
    assert deltas == ["ab", "", "€", "", ""]
    assert inc.update("ab€", True) == ""  # the engine cut the final text at the stop string
    inc2 = IncrementalText(stop=["XYZ"])
    parts = [inc2.update(t, False) for t in ("a", "aX", "aXq")] + [inc2.update("aXqr", True)]
    assert "".join(parts) == "aXqr" and parts[1] == ""


def test_spec_metrics_histogram_reconciles():
    m = spec_metrics_of(
        {"num_drafts": 5, "num_draft_tokens": 20, "num_accepted_tokens": 4, "accepted_per_pos": [3, 1]}, K
    )
    assert m.acceptance_histogram == [2, 2, 1, 0, 0]
    assert sum(m.acceptance_histogram) == m.num_spec_steps == 5
    assert sum(i * c for i, c in enumerate(m.acceptance_histogram)) == m.num_accepted_draft_tokens
    assert m.mean_acceptance_length == pytest.approx(1 + 4 / 5)
    assert spec_metrics_of({}, 0) is None


# ---- live server -------------------------------------------------------------------------------------------


def test_models_health_tokenize(spec_server):
    url, engine = spec_server
    models = client(url).models.list()
    assert [m.id for m in models.data] == ["target"]
    assert models.data[0].model_extra["max_model_len"] == engine.max_model_len
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/version").json()["version"]
    tok = httpx.post(f"{url}/tokenize", json={"prompt": "hello"}).json()
    assert tok["tokens"] == encode_prompt(engine, "hello") and tok["count"] == len(tok["tokens"])
    assert tok["tokens"][0] == engine.target.config.bos_token_id
    detok = httpx.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["prompt"] == engine.tokenizer.decode(tok["tokens"])
    chat_tok = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    r = client(url).chat.completions.create(
        model="target", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )
    assert r.usage.prompt_tokens == chat_tok["count"]


def test_greedy_completion_matches_offline_generate(pair, spec_server):
    url, _ = spec_server
    prompt, n = "hello world", 24
    r = client(url).completions.create(
        model="target", prompt=prompt, max_tokens=n, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = r.choices[0]
    params = SamplingParams(temperature=0.0, max_tokens=n)
    offline = LLM.from_engine(make_engine(pair)).generate(prompt, params)[0]
    plain = LLM.from_engine(make_engine(pair, spec=False)).generate(prompt, params)[0]
    assert choice.model_extra["token_ids"] == offline.token_ids == plain.token_ids
    assert choice.model_extra["prompt_token_ids"] == offline.prompt_token_ids
    assert choice.text == offline.text
    assert r.usage.completion_tokens == len(offline.token_ids)
    assert r.usage.prompt_tokens == len(offline.prompt_token_ids)
    spec = r.model_extra["metrics"]["speculative_decoding"]
    assert spec["num_spec_steps"] > 0 and len(spec["acceptance_histogram"]) == K + 1
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"]
    assert spec["mean_acceptance_length"] == pytest.approx(
        1 + spec["num_accepted_draft_tokens"] / spec["num_spec_steps"]
    )
    # the same request streamed: the deltas concatenate to the same text
    chunks = list(
        client(url).completions.create(model="target", prompt=prompt, max_tokens=n, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason


def test_chat_streaming_matches_non_streaming_and_reports_usage(spec_server):
    url, _ = spec_server
    c = client(url)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me a story"}]
    full = c.chat.completions.create(model="target", messages=msgs, max_tokens=20, temperature=0)
    stream = list(
        c.chat.completions.create(
            model="target",
            messages=msgs,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert content == full.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in stream if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    last = stream[-1]
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert last.model_extra["metrics"]["speculative_decoding"]["num_spec_steps"] > 0
    # chat default max_tokens: 256, capped by the context
    r = c.chat.completions.create(model="target", messages=msgs, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 256 and r.choices[0].finish_reason == "length"


def test_stop_strings_cut_text_in_both_modes(spec_server):
    url, _ = spec_server
    c = client(url)
    base = dict(model="target", prompt="abc", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    text = c.completions.create(**base).choices[0].text
    k = next(i for i in range(3, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    stop = text[k : k + 2]
    expected = text[: text.index(stop)]
    r = c.completions.create(**base, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(**base, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected


def test_32_concurrent_streaming_clients_all_complete(spec_server):
    url, engine = spec_server
    n_clients, n_tokens = 32, 8

    async def one(http: httpx.AsyncClient, i: int) -> list:
        body = {
            "prompt": f"client {i} says",
            "max_tokens": n_tokens,
            "temperature": 0.7,
            "seed": i,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            return sse_events([line async for line in r.aiter_lines()])

    async def main() -> list:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as http:
            return await asyncio.gather(*(one(http, i) for i in range(n_clients)))

    results = asyncio.run(main())
    assert len(results) == n_clients
    for events in results:
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[-1]["usage"]["completion_tokens"] == n_tokens
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    wait_idle(engine)


def test_bad_inputs_get_openai_errors_and_server_keeps_serving(spec_server):
    url, engine = spec_server
    comp, chat = f"{url}/v1/completions", f"{url}/v1/chat/completions"
    too_long = "a" * (engine.max_model_len + 10)
    cases = [
        (comp, b"{bad json", 400, None),
        (comp, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        (chat, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
        (comp, {"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
        (comp, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
        (comp, {"prompt": too_long, "max_tokens": 4}, 400, "prompt"),
        (comp, {"prompt": "x", "temperature": -1}, 400, "temperature"),
        (comp, {"prompt": "x", "top_p": 0}, 400, "top_p"),
        (comp, {"prompt": "x", "top_k": -5}, 400, "top_k"),
        (comp, {"prompt": "x", "top_k": 2**63}, 400, "top_k"),
        (comp, {"prompt": "x", "seed": 2**64}, 400, "seed"),
        (comp, {"prompt": "x", "seed": 2**63}, 400, "seed"),
        (comp, {"prompt": "x", "seed": -(2**64)}, 400, "seed"),
        (chat, {"messages": [{"role": "user", "content": "x"}], "seed": 2**64}, 400, "seed"),
        (comp, {"prompt": "x", "n": 0}, 400, "n"),
        (comp, {"prompt": "x", "stop": 5}, 400, "stop"),
        (comp, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        (comp, {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias.5"),
        (comp, {"prompt": "x", "logit_bias": {"a": 1}}, 400, None),  # the key is not a token id
        (comp, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
        (comp, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
        (comp, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
        (comp, {"prompt": "x", "min_tokens": -1}, 400, "min_tokens"),
        # structured outputs on a byte vocabulary too small to spell every byte: refused by name
        (comp, {"prompt": "x", "guided_regex": "a+"}, 400, "guided_regex"),
        (
            chat,
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
            400,
            "response_format",
        ),
        (comp, {"prompt": [10**6]}, 400, None),
        (comp, {"prompt": "x", "model": "no-such-model"}, 404, "model"),
        (comp, {"max_tokens": 3}, 400, "prompt"),
        (chat, {"messages": []}, 400, "messages"),
        (chat, {"messages": [{"role": "user", "content": too_long}]}, 400, "messages"),
        (chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages.0.content"),
        (chat, {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        (f"{url}/tokenize", {}, 400, None),
        (f"{url}/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ]
    for path, body, status, param in cases:
        kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {}
        r = httpx.post(path, json=None if kw else body, **kw)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (body, err)
        if param is not None:
            assert err["param"] == param, (body, err)
    with pytest.raises(openai.BadRequestError, match="best_of=2"):
        client(url).completions.create(model="target", prompt="x", best_of=2)
    ok = client(url).completions.create(model="target", prompt="still alive", max_tokens=3)
    assert ok.usage.completion_tokens >= 1 and httpx.get(f"{url}/health").status_code == 200
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"}}
    r = httpx.post(chat, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2} | neutral)
    assert r.status_code == 200, r.text  # their neutral values change nothing, so they are accepted
    wait_idle(engine)


def test_a_request_that_raises_in_the_engine_fails_alone(pair):
    engine = make_engine(pair, max_num_seqs=4)
    bad = [3, 1, 4, 1, 5]
    real = engine.runner.target_forward

    def faulty(reqs, *a, **kw):
        if any(r.prompt_ids == bad for r in reqs):
            raise RuntimeError("injected fault")
        return real(reqs, *a, **kw)

    engine.runner.target_forward = faulty
    gate = StepGate(engine)
    body = {"prompt": "survivor", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with serving(engine) as url, httpx.Client(timeout=60) as http, ThreadPoolExecutor(1) as pool:
        with http.stream("POST", f"{url}/v1/completions", json=body) as running:
            gate.allow()  # prefill + first token: the survivor is running
            wait_for(lambda: engine.metrics.generation_tokens > 0)
            failing = pool.submit(http.post, f"{url}/v1/completions", json={"prompt": bad, "max_tokens": 4})
            wait_for(lambda: any(r.prompt_ids == bad for r in list(engine.requests.values())))
            gate.allow()  # one step with both: the bad prefill raises, the survivor decodes
            r = failing.result(timeout=60)
            assert r.status_code == 500, r.text
            assert r.json()["error"]["code"] == "request_failed" and "injected fault" in r.json()["error"]["message"]
            assert http.get(f"{url}/health").status_code == 200
            assert engine.has_unfinished  # the survivor is still generating
            gate.open()
            events = sse_events(running.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        streamed = sse_events(http.post(f"{url}/v1/completions", json={**body, "prompt": bad}).iter_lines())
        assert "injected fault" in streamed[-2]["error"]["message"] and streamed[-1] == "[DONE]"
        ok = http.post(f"{url}/v1/completions", json={"prompt": "after", "max_tokens": 3})
        assert ok.status_code == 200 and http.get(f"{url}/health").status_code == 200
        wait_idle(engine)
        assert engine.metrics.num_requests_failed == 2


def test_api_key_guards_every_route_but_health(pair):
    engine = make_engine(pair, spec=False)
    with serving(engine, api_key="sekrit") as url:
        assert httpx.get(f"{url}/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
                r = httpx.request(method, f"{url}{path}", headers=headers, json={"prompt": "x"})
                assert r.status_code == 401, (headers, path)
                assert r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
        r = client(url, "sekrit").completions.create(model="target", prompt="x", max_tokens=2)
        assert r.usage.completion_tokens >= 1
        assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sekrit"}).status_code == 200


def test_full_queue_answers_503_and_disconnects_free_pages(pair):
    engine = make_engine(pair, spec=False, max_num_seqs=1, max_waiting=1)
    gate = StepGate(engine)  # the engine steps only when allowed: no request can finish behind the test's back
    total = engine.pool.num_pages
    body = {"prompt": "long one", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with serving(engine) as url, httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{url}/v1/completions", json=body):
            gate.allow()  # prefill + first token: the request is running and holds cache pages
            wait_for(lambda: engine.metrics.generation_tokens > 0)
            assert engine.num_pages_free < total
            with http.stream("POST", f"{url}/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200  # accepted into the (one-slot) waiting queue
                assert len(engine.scheduler.waiting) == 1
                r = http.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "queue_full"
        # both streams closed mid-way: the server aborts them and every page returns to the pool
        wait_for(lambda: engine.metrics.num_requests_aborted == 2)
        gate.open()
        wait_idle(engine)
        assert engine.num_pages_free == total
        assert engine.metrics.num_requests_aborted == 2
        m = scrape(url)
        assert m[("vllm:request_success_total", (("finished_reason", "abort"),))] == 2
        r = http.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        # a non-streaming client that goes away is aborted too (the engine is held, so it cannot finish first)
        gate.opened.clear()
        before = engine.metrics.num_requests_aborted
        with pytest.raises(httpx.ReadTimeout):
            http.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=0.3)
        wait_for(lambda: engine.metrics.num_requests_aborted == before + 1)
        gate.open()
        wait_idle(engine)


def test_metrics_counters_move_by_the_request(spec_server):
    url, engine = spec_server
    wait_idle(engine)
    before = scrape(url)
    r = client(url).completions.create(
        model="target", prompt="count me", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    after = scrape(url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    spec = r.model_extra["metrics"]["speculative_decoding"]
    assert delta("vllm:generation_tokens_total") == r.usage.completion_tokens == 12
    assert delta("vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:spec_decode_num_drafts_total") == spec["num_spec_steps"] > 0
    assert delta("vllm:spec_decode_num_draft_tokens_total") == spec["num_draft_tokens"] > 0
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    assert accepted == spec["num_accepted_draft_tokens"]
    per_pos = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(K)]
    assert sum(per_pos) == accepted and per_pos == spec["accepted_per_position"]
    assert delta("dspark:spec_decode_verify_len_count") == spec["num_spec_steps"]
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert after[("vllm:num_requests_running", ())] == 0
    assert after[("vllm:kv_cache_usage_perc", ())] == 0.0


def test_serve_cli_is_registered_with_local_defaults():
    from dspark.cli import build_parser

    args = build_parser().parse_args(["serve", "--api-key", "k"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.api_key == "k"
    assert args.func.__module__ == "dspark.serve.cli"


def test_loadtest_counts_what_the_server_sent(spec_server):
    from dspark.serve.loadtest import run

    url, engine = spec_server
    res = run(url + "/v1", concurrency=2, n=3, max_tokens=4)
    assert res.num_requests == 3 and res.num_errors == 0 and res.output_tokens == 12
    assert res.acceptance_length is not None and res.acceptance_length >= 1.0
    wait_idle(engine)
