"""Issue 31, the server's contract: it answers what its /openapi.json says, checked by a schema-driven fuzzer.

Schemathesis (pinned in the ``dev`` extra) runs over every operation with every check (``--checks all``), a fixed
seed and a few examples per operation, against a live uvicorn serving the bundled k3-mini + k3-mini-dspark pair;
any finding fails the test. Nothing is excluded. One check is adjusted, and a stricter one takes over from it:
``positive_data_acceptance`` also allows 400, because a request valid by the schema can still exceed a limit of
the served model or of the server's flags (context length, vocabulary, chat template, prompts per request) that
no JSON Schema can state; ``deployment_limits_only`` (tests/conformance_checks.py) then fails every such 400
whose error code is not one of ``DEPLOYMENT_LIMIT_CODES``.

Generation stays cheap because the engine's context is short (``MAX_MODEL_LEN``): the server refuses a max_tokens
the context cannot hold (400, ``context_length_exceeded``) instead of clamping it, so no request generates more
than ``MAX_MODEL_LEN`` tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from dspark.llm import MLA_DRAFT, MLA_TARGET, build_engine
from dspark.serve.protocol import DEPLOYMENT_LIMIT_CODES
from serve_helpers import serving

pytestmark = pytest.mark.skipif(
    not (MLA_TARGET / "config.json").exists() or not (MLA_DRAFT / "config.json").exists(),
    reason="needs the bundled k3-mini pair",
)

SEED = 31
MAX_EXAMPLES = 5  # per operation, in the fuzzing phase (the coverage phase adds its own boundary cases)
MAX_MODEL_LEN = 20
NUM_SPECULATIVE_TOKENS = 2
TESTS_DIR = Path(__file__).resolve().parent

# positive_data_acceptance: Schemathesis' default statuses plus 400, which deployment_limits_only vets
SCHEMATHESIS_CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "3xx", "400", "401", "403", "404", "409", "429", "5xx"]
"""


@pytest.fixture(scope="module")
def server():
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))  # not more threads than the cores we may use
    spec = {"method": "dspark", "model": str(MLA_DRAFT), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    engine = build_engine(MLA_TARGET, spec, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
    try:
        with serving(engine) as url:
            yield url, engine
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def openapi(server):
    return httpx.get(f"{server[0]}/openapi.json").json()


# ---- item 10: every invalid body is a 400 with the error object -----------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, None),
        ("/tokenize", [], None),
        ("/v1/completions", {"prompt": "x", "top_k": 2.5}, "top_k"),
        ("/v1/completions", {"prompt": [[1], [-1]]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ],
)
def test_invalid_bodies_get_400_error_objects(server, path, body, param):
    r = httpx.post(f"{server[0]}{path}", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param, err


def test_deployment_limits_carry_their_codes(server):
    url, engine = server
    long_prompt = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": MAX_MODEL_LEN})
    out_of_vocab = httpx.post(f"{url}/v1/completions", json={"prompt": [engine.target.config.vocab_size]})
    template = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "tool", "content": "x"}]})  # user/assistant
    codes = [r.json()["error"]["code"] for r in (long_prompt, out_of_vocab, template)]
    assert codes == ["context_length_exceeded", "token_id_out_of_range", "chat_template_error"]
    assert set(codes) <= DEPLOYMENT_LIMIT_CODES


def test_openapi_states_the_served_models_limits(server, openapi):
    url, engine = server
    defs = openapi["components"]["schemas"]
    prompt = defs["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    ids, batch = prompt[2], prompt[3]
    vocab = engine.target.config.vocab_size
    assert ids["items"] == {"type": "integer", "minimum": 0, "maximum": vocab - 1} and ids["maxItems"] == 19
    assert batch["items"]["items"]["maximum"] == vocab - 1
    assert defs["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == vocab - 1
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        assert defs[name]["properties"]["max_tokens"]["anyOf"][0]["maximum"] == MAX_MODEL_LEN - 1
    roles = defs["ChatMessage"]["properties"]["role"]["enum"]
    assert roles == ["system", "user", "assistant", "developer"]  # the template renders user / assistant
    assert "x-dspark" not in str(openapi)  # every marker was replaced


def test_system_messages_the_template_refuses_are_folded_into_the_first_user_turn(server):
    url, engine = server
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    got = httpx.post(f"{url}/tokenize", json={"messages": chat}).json()["tokens"]
    assert got == engine.tokenizer.encode_chat([{"role": "user", "content": "be brief\n\nhi"}])
    alone = httpx.post(f"{url}/tokenize", json={"messages": chat[:1]}).json()["tokens"]
    assert alone == engine.tokenizer.encode_chat([{"role": "user", "content": "be brief"}])


def test_tokenize_kinds_encode_as_the_generation_routes(server):
    url, engine = server
    chat = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    prompt = httpx.post(f"{url}/tokenize", json={"prompt": "hi"}).json()
    assert chat["tokens"] == engine.tokenizer.encode_chat([{"role": "user", "content": "hi"}])  # the template's
    assert prompt["tokens"] == engine.tokenizer.encode("hi", True)
    assert chat["count"] == len(chat["tokens"]) and chat["max_model_len"] == MAX_MODEL_LEN


def test_integral_numbers_are_integers(server):
    r = httpx.post(f"{server[0]}/v1/completions", json={"prompt": [10.0, 11], "max_tokens": 2.0, "seed": 7.0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_batch_without_max_tokens_fills_each_prompts_context(server):
    r = httpx.post(f"{server[0]}/v1/completions", json={"prompt": [[10] * 4, [10] * 9], "max_tokens": None})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 13
    assert r.json()["usage"]["completion_tokens"] <= (MAX_MODEL_LEN - 4) + (MAX_MODEL_LEN - 9)


# ---- items 11, 12: the description says what the server answers -------------------------------------------------


def _ref(schema: dict) -> str:
    return schema.get("$ref", "").rsplit("/", 1)[-1]


def test_openapi_declares_error_responses_and_media_types(openapi):
    ops = {(m.upper(), p): op for p, item in openapi["paths"].items() for m, op in item.items()}
    for (method, path), op in ops.items():
        responses = op["responses"]
        assert "422" not in responses, (method, path)  # validation errors are 400s here
        for status, resp in responses.items():
            if status != "200":
                assert _ref(resp["content"]["application/json"]["schema"]) == "ErrorResponse", (path, status)
        if method == "POST":
            assert {"400", "404", "413", "4XX"} <= set(responses), (path, sorted(responses))
    for path in ("/v1/completions", "/v1/chat/completions"):
        content = ops["POST", path]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
        assert content["text/event-stream"]["schema"]["required"] == ["data"]  # one event (OpenAPI 3.1)
    assert "503" in ops["POST", "/v1/completions"]["responses"]
    assert list(ops["GET", "/metrics"]["responses"]["200"]["content"]) == ["text/plain; version=0.0.4; charset=utf-8"]
    assert "content" not in ops["GET", "/health"]["responses"]["200"]  # an empty body
    tokenize = ops["POST", "/tokenize"]["requestBody"]["content"]["application/json"]["schema"]
    assert sorted(_ref(s) for s in tokenize["oneOf"]) == ["TokenizeChatRequest", "TokenizeCompletionRequest"]


def test_served_media_types_match_the_description(server):
    url, _ = server
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.content == b"" and "content-type" not in health.headers
    assert httpx.get(f"{url}/metrics").headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    body = {"prompt": "hi", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert list(r.iter_lines())[-2:] == ["data: [DONE]", ""]


def test_wrong_method_is_405_with_allow(server):
    r = httpx.request("TRACE", f"{server[0]}/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    assert r.json()["error"]["type"] == "invalid_request_error"


# ---- the fuzzer ---------------------------------------------------------------------------------------------------


def test_schemathesis_finds_nothing(server, tmp_path):
    _fuzz(*server, tmp_path)


@pytest.mark.parametrize("model, max_model_len", [("kimi-k3-mini", MAX_MODEL_LEN), ("smollm2-135m-instruct", 64)])
def test_schemathesis_finds_nothing_on_the_other_bundled_models(model, max_model_len, tmp_path):
    """The schema states each served model's limits (vocabulary, context, the roles its template renders): the
    default pair and SmolLM2 pass the same run. SmolLM2 gets a 64-token context: its chat template's default system
    turn alone is ~20 tokens, so a 20-token context would refuse every chat body for length."""
    from dspark.checkpoint.resolve import resolve_model_ref
    from dspark.config import ConfigError

    try:
        resolve_model_ref(model)
    except ConfigError as e:  # SmolLM2 comes with the smollm2 extra
        pytest.skip(str(e))
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    spec = {"method": "dspark", "num_speculative_tokens": 2}  # the drafter shipped for the model
    engine = build_engine(model, spec, max_model_len=max_model_len, max_num_seqs=2)
    try:
        with serving(engine) as url:
            _fuzz(url, engine, tmp_path)
    finally:
        torch.set_num_threads(threads)


def _fuzz(url: str, engine, tmp_path: Path) -> None:
    pytest.importorskip("schemathesis", reason="the fuzzer comes with the dev extra: pip install -e '.[dev]'")
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_CONFIG)
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color",
        "run", f"{url}/openapi.json",
        "--checks", "all",
        "--seed", str(SEED),
        "--max-examples", str(MAX_EXAMPLES),
        "--workers", "1",  # 4.32.5's coverage phase is not thread-safe (a Hypothesis FlakyFailure with more)
        "--generation-database", "none",
        "--request-timeout", "120",
    ]  # fmt: skip
    env = os.environ | {
        "SCHEMATHESIS_HOOKS": "conformance_checks",
        "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-12000:]
    assert "8 selected / 8 total" in report and "No issues found" in report, report[-3000:]
    assert engine.metrics.generation_tokens > 0  # the fuzzer's requests reached the engine
