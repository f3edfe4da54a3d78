"""The server against hostile or careless clients and operators: tokenization off the event loop, body-size and
prompt-count limits, lone surrogates and strict JSON types, keep-alive across a 500, and the API-key rules
(no empty key, $DSPARK_API_KEY, a warning for a public bind without a key)."""

from __future__ import annotations

import http.client
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest
from fastapi.testclient import TestClient

from dspark.cli import main
from dspark.config import ConfigError
from dspark.models.tiny import write_tiny_pair
from dspark.serve.app import create_app
from dspark.serve.cli import bind_warning
from dspark.serve.config import ServerConfig
from serve_helpers import make_engine, serving


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def server(pair):
    engine = make_engine(pair, spec=False)
    with serving(engine, config=ServerConfig(max_request_bytes=4096, max_prompts_per_request=4)) as url:
        yield url, engine


# ---- item 7: the event loop never waits on the tokenizer; limits ---------------------------------------------


class SlowTokenizer:
    """Wraps the engine's tokenizer: ``encode`` of ``marker`` blocks until the test releases it."""

    def __init__(self, inner, marker: str) -> None:
        self.inner, self.marker = inner, marker
        self.started, self.release = threading.Event(), threading.Event()

    def encode(self, text: str, *args, **kw) -> list[int]:
        if self.marker in text:
            self.started.set()
            assert self.release.wait(60), "never released"
        return self.inner.encode(text, *args, **kw)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_health_answers_while_a_prompt_is_being_tokenized(pair, route):
    engine = make_engine(pair, spec=False)
    slow = engine.tokenizer = SlowTokenizer(engine.tokenizer, "HUGE")
    if route == "completions":
        path, body = "/v1/completions", {"prompt": "a HUGE prompt", "max_tokens": 2}
    else:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "HUGE"}], "max_tokens": 2}
    with serving(engine) as url, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{url}{path}", json=body, timeout=60)
        try:
            assert slow.started.wait(30)
            health = httpx.get(f"{url}/health", timeout=10)  # the event loop is free while tokenizing
            models = httpx.get(f"{url}/v1/models", timeout=10)
        finally:
            slow.release.set()
        assert health.status_code == 200 and models.status_code == 200
        assert pending.result(timeout=60).status_code == 200


def test_a_body_over_max_request_bytes_gets_413(server):
    url, _ = server
    big = {"prompt": "x" * 5000, "max_tokens": 2}
    r = httpx.post(f"{url}/v1/completions", json=big)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "4096" in err["message"] and "--max-request-bytes" in err["message"]
    chunked = httpx.post(  # no Content-Length: counted while it streams in
        f"{url}/v1/completions", content=iter([b'{"prompt": "', b"x" * 5000, b'"}']), headers={"Content-Type": "json"}
    )
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    under = {"prompt": "x", "max_tokens": 2, "user": "u" * 3000}
    assert httpx.post(f"{url}/v1/completions", json=under).status_code == 200


def test_too_many_prompts_in_one_request_gets_400(server):
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ["a"] * 5, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "--max-prompts-per-request" in err["message"] and "4" in err["message"]
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": ["a"] * 4, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_serve_flags_default_to_server_config():
    from dspark.cli import build_parser

    args = build_parser().parse_args(["serve"])
    d = ServerConfig()
    assert args.max_request_bytes == d.max_request_bytes and args.max_prompts_per_request == d.max_prompts_per_request
    with pytest.raises(ConfigError, match="max_prompts_per_request"):
        ServerConfig(max_prompts_per_request=0)


# ---- item 8: valid Unicode, strict types, keep-alive after a 500 ------------------------------------------------


def raw_post(url: str, path: str, raw_json: str) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=raw_json.encode(), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(
    "path, raw, param",
    [
        ("/v1/completions", r'{"prompt": "a\ud800b"}', "prompt"),
        ("/v1/completions", r'{"prompt": ["ok", "\udfff"]}', "prompt.1"),
        ("/v1/completions", r'{"prompt": "x", "stop": ["\ud800"]}', "stop.0"),
        ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages.0.content"),
        ("/tokenize", r'{"prompt": "\ud800"}', "prompt"),
    ],
)
def test_lone_surrogates_get_400_naming_the_field(server, path, raw, param):
    r = raw_post(server[0], path, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"], err


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "temperature": "0.5"}, "temperature"),
        ({"prompt": "x", "seed": 1.5}, "seed"),
        ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
    ],
)
def test_strict_types_and_empty_prompts_get_400(server, body, param):
    r = httpx.post(f"{server[0]}/v1/completions", json=body)
    assert r.status_code == 400, (body, r.text)
    assert r.json()["error"]["param"] == param, r.json()


def test_a_500_keeps_the_connection_alive(pair):
    engine = make_engine(pair, spec=False)
    inner = engine.tokenizer

    class Exploding:
        def encode(self, text: str, *args, **kw) -> list[int]:
            if "boom" in text:
                raise RuntimeError("tokenizer exploded")
            return inner.encode(text, *args, **kw)

        def __getattr__(self, name: str):
            return getattr(inner, name)

    engine.tokenizer = Exploding()
    with serving(engine) as url:
        u = urlparse(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/completions", body='{"prompt": "boom"}', headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 500 and b"tokenizer exploded" in body and b'"server_error"' in body
        sock = conn.sock
        assert sock is not None, "the server asked to close the connection after a 500"
        conn.request("GET", "/health")
        again = conn.getresponse()
        again.read()
        assert again.status == 200 and conn.sock is sock  # same TCP connection
        conn.close()


# ---- item 9: API keys ---------------------------------------------------------------------------------------


@pytest.fixture
def no_uvicorn(monkeypatch):
    apps = []
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: apps.append((app, kw)))
    monkeypatch.delenv("DSPARK_API_KEY", raising=False)
    return apps


@pytest.mark.parametrize("flag, env", [("", None), (None, ""), ("  ", "ok")])
def test_an_empty_api_key_is_refused_before_loading(monkeypatch, capsys, no_uvicorn, flag, env):
    def no_load(*a, **kw):
        raise AssertionError("the engine must not be built")

    monkeypatch.setattr("dspark.llm.build_engine", no_load)
    if env is not None:
        monkeypatch.setenv("DSPARK_API_KEY", env)
    argv = ["serve"] + (["--api-key", flag] if flag is not None else [])
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "API key is empty" in err and "give neither" in err
    assert not no_uvicorn


def test_create_app_refuses_an_empty_key(pair):
    with pytest.raises(ConfigError, match="API key is empty"):
        create_app(make_engine(pair, spec=False), api_key="")


def test_the_api_key_can_come_from_the_environment(pair, monkeypatch, capsys, no_uvicorn):
    monkeypatch.setenv("DSPARK_API_KEY", "from-env")
    assert main(["serve", "--model", str(pair[0]), "--no-spec", "--dtype", "float32"]) == 0
    ((app, kw),) = no_uvicorn
    for _ in range(2):  # the app survives a second start after a shutdown
        with TestClient(app) as c:
            assert c.get("/v1/models").status_code == 401
            auth = {"Authorization": "Bearer from-env"}
            assert c.get("/v1/models", headers=auth).status_code == 200
            assert c.post("/tokenize", json={"prompt": "hi"}, headers=auth).json()["count"] >= 1
            assert c.get("/health").status_code == 200
    assert "without an API key" not in capsys.readouterr().err


def test_a_public_bind_without_a_key_warns(pair, capsys, no_uvicorn):
    assert main(["serve", "--model", str(pair[0]), "--no-spec", "--dtype", "float32", "--host", "0.0.0.0"]) == 0
    assert "warning: serving on 0.0.0.0 without an API key" in capsys.readouterr().err
    assert no_uvicorn[0][1]["host"] == "0.0.0.0"
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert bind_warning(host, None) is None
    assert bind_warning("0.0.0.0", "k") is None and bind_warning("myhost.example", None) is not None


# ---- item 14: the server is small routers over one state, not one 275-line function ----------------------------


def test_serve_functions_are_short():
    import ast
    from pathlib import Path

    import dspark.serve

    lengths = {}
    for f in Path(dspark.serve.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lengths[f"{f.stem}.{node.name}"] = node.end_lineno - node.lineno + 1
    longest = max(lengths, key=lengths.get)
    assert lengths[longest] <= 80, (longest, lengths[longest])
    p90 = sorted(lengths.values())[int(0.9 * len(lengths))]
    assert p90 <= 30 and lengths["app.create_app"] <= 40, (p90, lengths["app.create_app"])
