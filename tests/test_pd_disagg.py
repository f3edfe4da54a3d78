"""Prefill/decode disaggregation: a request prefilled on one engine, its pages' rows (target and drafter, every
pool), its recurrent state and first token shipped as one payload, and decoded speculatively on another engine —
token for token what one engine produces, on MLA, GQA (one and two pools) and hybrid KDA + MLA targets; the payload's
exact size; corrupt, mismatched and roomless payloads refused, changing nothing. Then the servers: a prefill and a
decode instance in their own processes on loopback behind the proxy, and the fallbacks when the transfer fails."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from dspark.config import CacheConfig, ConfigError, EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.engine.transfer import (
    TransferError,
    export_request,
    frame,
    header_size,
    hold_for_export,
    import_request,
    read_payload,
)
from dspark.llm import LLM, build_engine
from dspark.models.tiny import (
    build_tiny_gqa_pair,
    build_tiny_hybrid_pair,
    build_tiny_pair,
    tiny_gqa_config,
    tiny_gqa_draft_config,
    write_tiny_pair,
)
from dspark.sampling_params import SamplingParams
from dspark.serve.config import ServerConfig
from dspark.serve.proxy import create_proxy_app
from serve_helpers import make_engine, serving, sse_events, wait_idle

P = 4
BUILDERS = {
    "mla": build_tiny_pair,  # the drafter's rows: extra layers of the target's pool
    "gqa": build_tiny_gqa_pair,
    "gqa-2pools": lambda seed: build_tiny_gqa_pair(  # the drafter's rows in a second pool, the same page ids
        seed, tiny_gqa_config(), tiny_gqa_draft_config(tiny_gqa_config(), share_pages=False)
    ),
    "hybrid": build_tiny_hybrid_pair,  # + the KDA layers' recurrent state slot
}
PAIRS: dict = {}
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def pair(family):
    if family not in PAIRS:
        PAIRS[family] = BUILDERS[family](0)
    return PAIRS[family]


def engine(family, spec=True, max_num_seqs=8, **cache):
    target, drafter = pair(family)
    cfg = SpeculativeConfig(method="dspark", num_speculative_tokens=3, speculation_guard=False) if spec else None
    ecfg = EngineConfig(dtype="float32", max_num_seqs=max_num_seqs)
    return Engine(target, drafter, cfg, ecfg, CacheConfig(page_size=P, **cache))


def tokens(seed, n):
    return torch.randint(4, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(eng, prompt, params):
    """Run ``prompt`` on ``eng`` up to its first token, held for export."""
    req = hold_for_export(eng, prompt, params)
    while eng.has_unfinished:
        eng.step()
    assert req.finished and req.finish_reason == "length" and len(req.output_ids) == 1
    return req


def decode(eng, req):
    prefills = []
    real = eng._prefill
    eng._prefill = lambda chunks: (prefills.append(chunks), real(chunks))  # type: ignore[method-assign]
    while eng.has_unfinished:
        eng.step()
    assert prefills == [], "an imported request must go straight into decode"
    return req.output_ids


def record_drafts(eng):
    """{tokens up to the anchor: the drafter's block and confidences there}, filled as ``eng`` proposes."""
    seen, propose = {}, eng.runner.propose_draft

    def recorded(reqs, *args, **kwargs):
        proposal = propose(reqs, *args, **kwargs)
        for i, r in enumerate(reqs):
            conf = proposal.confidence[i].tolist() if proposal.confidence is not None else None
            seen[tuple(r.all_ids[: r.num_computed + 1])] = (proposal.tokens[i].tolist(), conf)
        return proposal

    eng.runner.propose_draft = recorded
    return seen


def expected_bytes(eng, num_tokens, payload):
    """pages × page_size × bytes per token of every pool + the state slot + the header."""
    rep = eng.cache_report()
    per_token = rep["target_bytes_per_token"] + rep["draft_bytes_per_token"]
    return math.ceil(num_tokens / P) * P * per_token + rep.get("state_bytes_per_request", 0) + header_size(payload)


# ---- in process: engine A prefills, engine B decodes ----------------------------------------------------------


@pytest.mark.parametrize("n_prompt", [13, 16])
@pytest.mark.parametrize("family", ["mla", "gqa", "gqa-2pools", "hybrid"])
def test_export_import_decodes_exactly_as_one_engine(family, n_prompt):
    prompt = tokens(n_prompt, n_prompt)
    one = engine(family)
    ref_drafts = record_drafts(one)
    ref = LLM.from_engine(one).generate([prompt], GREEDY)[0].token_ids
    a, b = engine(family), engine(family)
    drafts = record_drafts(b)
    req = prefill(a, prompt, GREEDY)
    assert req.output_ids == ref[:1] and a.num_pages_free < a.pool.num_pages  # held: pages kept at its finish
    payload = export_request(a, req, GREEDY)
    assert a.num_pages_free == a.pool.num_pages  # the export frees them
    if a.states is not None:
        assert len(a.states.free) == a.states.num_slots and b.states is not None
    assert len(payload) == expected_bytes(a, n_prompt, payload)
    header, _ = read_payload(payload)
    assert header["num_computed"] == n_prompt and header["output_token_ids"] == ref[:1]
    assert header["sampling_params"]["max_tokens"] == GREEDY.max_tokens  # the whole request's, not max_tokens=1
    if family == "gqa-2pools":
        assert [p["name"] for p in header["pools"]] == ["target", "draft"]
    got = import_request(b, payload)
    assert got.num_computed == n_prompt and got.output_ids == ref[:1] and got.request_id in b.requests
    assert decode(b, got) == ref
    assert drafts == ref_drafts  # the drafter read the shipped context rows as its own: the same block everywhere
    assert b.metrics.spec.num_drafts > 0 and b.num_pages_free == b.pool.num_pages


def test_seeded_sampling_continues_the_same_stream():
    """The seed travels: a sampled request decoded elsewhere draws the same numbers as on one engine."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    prompt = tokens(5, 11)
    ref = LLM.from_engine(engine("mla")).generate([prompt], params)[0].token_ids
    a, b = engine("mla"), engine("mla")
    req = prefill(a, prompt, params)
    got = import_request(b, export_request(a, req, params), request_id="moved")
    assert got.request_id == "moved" and decode(b, got) == ref


def test_prefix_caching_on_both_sides_and_a_stop_at_the_first_token():
    """Held pages shared with the prefix cache are read and released like private ones; a payload whose first
    token already ends the request finishes on import."""
    prompt = tokens(7, 18)
    ref = LLM.from_engine(engine("mla")).generate([prompt], GREEDY)[0].token_ids
    a, b = engine("mla", enable_prefix_caching=True), engine("mla", enable_prefix_caching=True)
    LLM.from_engine(a).generate([prompt[:12] + [5]], SamplingParams(temperature=0, max_tokens=2))
    req = prefill(a, prompt, GREEDY)
    assert req.num_cached_tokens == 12  # its first three blocks came from the cache
    assert decode(b, import_request(b, export_request(a, req, GREEDY))) == ref
    one = SamplingParams(temperature=0, max_tokens=1)
    done = import_request(b, export_request(a, prefill(a, prompt, one), one))
    assert done.finished and done.finish_reason == "length"
    (out,) = b.step()
    assert out.finished and out.token_ids == ref[:1] and b.num_pages_free == b.pool.num_pages
    assert a.num_pages_free == a.pool.num_pages


def _unchanged(eng):
    assert not eng.requests and not eng.has_unfinished and eng.num_pages_free == eng.pool.num_pages


def test_corrupt_mismatched_and_roomless_payloads_are_refused_changing_nothing():
    prompt = tokens(9, 10)
    a = engine("mla")
    payload = export_request(a, prefill(a, prompt, GREEDY), GREEDY)
    b = engine("mla")
    flipped = bytearray(payload)
    flipped[-5] ^= 0x40  # one bit of one row
    with pytest.raises(TransferError, match="checksum mismatch.*falls back to a local prefill"):
        import_request(b, bytes(flipped))
    with pytest.raises(TransferError, match="checksum mismatch"):
        import_request(b, payload[:-7])  # truncated
    with pytest.raises(TransferError, match="not a dspark KV payload"):
        import_request(b, b"GET / HTTP/1.1\r\n" + payload)
    with pytest.raises(TransferError, match="'prompt_token_ids'"):
        import_request(b, payload, prompt_token_ids=prompt[:-1])
    header, body = read_payload(payload)
    raw = [torch.frombuffer(bytearray(body), dtype=torch.uint8)]
    with pytest.raises(TransferError, match="key 'seed' = 'x' is not a int"):  # checksummed, but not ours
        import_request(b, frame(header | {"seed": "x"}, raw))
    _unchanged(b)
    with pytest.raises(TransferError, match="key 'target_format'.*same target, drafter"):
        import_request(engine("gqa"), payload)
    with pytest.raises(TransferError, match="key 'draft_format' = .* but this instance has None"):
        import_request(engine("mla", spec=False), payload)
    h = engine("hybrid")
    header, body = read_payload(export_request(h, prefill(h, prompt, GREEDY), GREEDY))
    header["state"]["shape"][0] += 1  # a state slot of another shape (a different KDA geometry)
    with pytest.raises(TransferError, match="key 'state' = .*'shape': \\[(\\d+)"):
        import_request(h, frame(header, [torch.frombuffer(bytearray(body), dtype=torch.uint8)]))
    _unchanged(h)
    full = engine("mla", max_num_seqs=1)
    busy = full.add_request(tokens(3, 5), GREEDY)
    full.step()
    with pytest.raises(TransferError, match="request id 'req-0' is already in use"):
        import_request(full, payload)
    with pytest.raises(TransferError, match="max_num_seqs"):
        import_request(full, payload, request_id="moved")
    assert list(full.requests) == [busy.request_id] and full.blocks.request_ids() == [busy.request_id]
    with pytest.raises(TransferError, match="holds no pages to export"):
        export_request(a, a.add_request(prompt, GREEDY))


# ---- the prefill side in process: a push that times out ---------------------------------------------------------


def test_a_push_that_times_out_is_reported_and_frees_everything(tmp_path, caplog):
    """The decode URL accepts connections but never answers: the push gives up after --kv-transfer-timeout, the
    prefill instance says so (the proxy then has the decode instance prefill) and keeps no pages or state."""
    engine = make_engine(write_tiny_pair(tmp_path))
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # connections complete in the backlog; nothing ever reads or answers them
    decode_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    kv = {"transfer_id": "xfer-slow", "do_remote_decode": True, "decode_url": decode_url}
    config = ServerConfig(role="prefill", kv_transfer_timeout_s=0.3)
    with silent, serving(engine, config=config) as url:
        r = httpx.post(f"{url}/v1/completions", json=BODY | {"kv_transfer_params": kv}, timeout=30)
        assert r.status_code == 200, r.text
        out = r.json()["kv_transfer_params"]
        assert out["status"] == "failed" and "Timeout" in out["error"] and len(r.json()["choices"][0]["token_ids"]) == 1
        refused = httpx.post(f"{url}/v1/kv_transfer/x", content=b"...")  # a prefill instance takes no payloads
        assert refused.status_code == 400 and "role is 'prefill'" in refused.json()["error"]["message"]
        wait_idle(engine)
    assert "kv transfer xfer-slow to " in caplog.text and "the decode instance will prefill the request" in caplog.text
    assert engine.num_pages_free == engine.pool.num_pages and not engine.requests
    with pytest.raises(ConfigError, match="role='proxy': use one of"):
        ServerConfig(role="proxy")


# ---- two processes on loopback behind the proxy -------------------------------------------------------------------

PROMPT = "disaggregated hello"
N_TOKENS = 24
SERVE_P = 16  # the servers' page size (CacheConfig's default)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_instance(role: str, target, spec: dict, tmp: Path) -> tuple[subprocess.Popen, Path, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "dspark.cli", "serve", str(target), "--speculative-config", json.dumps(spec)]
    cmd += ["--dtype", "float32", "--role", role, "--port", str(port), "--log-level", "warning"]
    log = tmp / f"{role}.log"
    env = os.environ | {"DSPARK_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, log, f"http://127.0.0.1:{port}"


def wait_up(proc: subprocess.Popen, log: Path, url: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"dspark serve exited {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"dspark serve did not come up:\n{log.read_text()}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)


@contextlib.contextmanager
def proxy_serving(prefill: str, decode: str):
    server = uvicorn.Server(
        uvicorn.Config(create_proxy_app(prefill, decode), host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the proxy did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


@dataclass
class Cluster:
    prefill: str
    decode: str
    proxy: str
    procs: dict
    engine: Engine  # the same models in this process: the single-instance reference and payloads made here

    def log(self, role: str) -> str:
        return self.procs[role][1].read_text()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    target, draft = write_tiny_pair(tmp)
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 4, "speculation_guard": False}
    procs = {role: start_instance(role, target, spec, tmp) for role in ("prefill", "decode")}  # both start at once
    try:
        for proc, log, url in procs.values():
            wait_up(proc, log, url)
        with proxy_serving(procs["prefill"][2], procs["decode"][2]) as proxy:
            ref = build_engine(target, spec, dtype="float32")
            yield Cluster(procs["prefill"][2], procs["decode"][2], proxy, procs, ref)
    finally:
        for proc, _, _ in procs.values():
            proc.terminate()
            proc.wait(30)


def scrape(url: str) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in fam.samples:
            out[(s.name, s.labels.get("direction") or s.labels.get("path"))] = s.value
    return out


def delta(before: dict, after: dict, name: str, label: str | None = None) -> float:
    return after.get((name, label), 0.0) - before.get((name, label), 0.0)


def reference(cluster: Cluster, prompt: str = PROMPT, n: int = N_TOKENS) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return LLM.from_engine(cluster.engine).generate(prompt, params)[0].token_ids


BODY = {"prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def test_through_the_proxy_the_decode_instance_continues_what_the_prefill_instance_began(cluster):
    urls = {"prefill": cluster.prefill, "decode": cluster.decode, "proxy": cluster.proxy}
    before = {k: scrape(u) for k, u in urls.items()}
    r = httpx.post(f"{cluster.proxy}/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == reference(cluster) and choice["finish_reason"] == "length"
    assert r.json()["metrics"]["speculative_decoding"]["num_spec_steps"] > 0  # the decode instance speculated
    with httpx.stream("POST", f"{cluster.proxy}/v1/completions", json=BODY | {"stream": True}, timeout=60) as s:
        events = sse_events(s.iter_lines())
    assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]) == choice["text"]
    chat = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 12, "temperature": 0}
    with httpx.stream("POST", f"{cluster.proxy}/v1/chat/completions", json=chat | {"stream": True}, timeout=60) as s:
        streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in sse_events(s.iter_lines())[:-1])
    alone = httpx.post(f"{cluster.decode}/v1/chat/completions", json=chat, timeout=60).json()  # one instance
    assert streamed == alone["choices"][0]["message"]["content"]
    after = {k: scrape(u) for k, u in urls.items()}
    sent = delta(before["prefill"], after["prefill"], "dspark:kv_transfer_bytes_total", "sent")
    assert sent > 0 and sent == delta(before["decode"], after["decode"], "dspark:kv_transfer_bytes_total", "received")
    assert delta(before["decode"], after["decode"], "dspark:kv_transfer_requests_total", "imported") == 3
    assert delta(before["decode"], after["decode"], "dspark:kv_transfer_fallbacks_total") == 0
    assert delta(before["proxy"], after["proxy"], "dspark:proxy_requests_total", "disaggregated") == 3


def test_the_bytes_shipped_are_pages_times_bytes_per_token_plus_the_header(cluster):
    """The proxy's two calls made by hand: the prefill instance reports what it pushed; the counters agree."""
    before = {k: scrape(u) for k, u in (("p", cluster.prefill), ("d", cluster.decode))}
    kv = {"transfer_id": "xfer-bytes", "do_remote_decode": True, "decode_url": cluster.decode}
    first = httpx.post(f"{cluster.prefill}/v1/completions", json=BODY | {"kv_transfer_params": kv}, timeout=60).json()
    out = first["kv_transfer_params"]
    assert out["status"] == "sent" and first["choices"][0]["token_ids"] == reference(cluster)[:1]
    rep = cluster.engine.cache_report()  # the tiny MLA pair: one pool (the drafter's layers after the target's)
    pages = math.ceil(len(first["choices"][0]["prompt_token_ids"]) / SERVE_P)
    per_token = rep["target_bytes_per_token"] + rep["draft_bytes_per_token"]
    assert out["bytes"] == pages * SERVE_P * per_token + out["header_bytes"]
    after = {k: scrape(u) for k, u in (("p", cluster.prefill), ("d", cluster.decode))}
    assert delta(before["p"], after["p"], "dspark:kv_transfer_bytes_total", "sent") == out["bytes"]
    assert delta(before["d"], after["d"], "dspark:kv_transfer_bytes_total", "received") == out["bytes"]
    kv = {"transfer_id": "xfer-bytes", "do_remote_prefill": True}
    rest = httpx.post(f"{cluster.decode}/v1/completions", json=BODY | {"kv_transfer_params": kv}, timeout=60)
    assert rest.json()["choices"][0]["token_ids"] == reference(cluster)
    wrong_role = httpx.post(f"{cluster.prefill}/v1/completions", json=BODY | {"kv_transfer_params": kv})
    assert wrong_role.status_code == 400 and "role is 'prefill'" in wrong_role.json()["error"]["message"]


def test_a_corrupt_payload_is_refused_and_the_request_prefills_locally(cluster):
    eng = cluster.engine  # the same models and paths as the servers: its payloads are theirs
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    payload = export_request(eng, prefill(eng, eng.tokenizer.encode(PROMPT), params), params)
    bad = bytearray(payload)
    bad[len(bad) // 2] ^= 0x01  # one bit, in transit
    r = httpx.post(f"{cluster.decode}/v1/kv_transfer/xfer-bad", content=bytes(bad))
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_transfer_refused"
    assert "checksum mismatch" in r.json()["error"]["message"]
    assert httpx.post(f"{cluster.decode}/v1/kv_transfer/xfer-good", content=payload).status_code == 200
    before = scrape(cluster.decode)
    for tid in ("xfer-bad", "xfer-good", "xfer-never-sent"):
        body = BODY | {"kv_transfer_params": {"transfer_id": tid, "do_remote_prefill": True}}
        r = httpx.post(f"{cluster.decode}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == reference(cluster), tid
    after = scrape(cluster.decode)
    assert delta(before, after, "dspark:kv_transfer_fallbacks_total") == 2
    assert delta(before, after, "dspark:kv_transfer_requests_total", "imported") == 1
    log = cluster.log("decode")
    assert "kv transfer 'xfer-bad' was refused on arrival: kv transfer: checksum mismatch" in log
    assert "kv transfer 'xfer-never-sent': no payload arrived" in log and "locally instead (fallback)" in log
    assert httpx.get(f"{cluster.decode}/health").status_code == 200


def test_with_the_decode_instance_killed_every_request_is_still_answered(cluster, caplog):
    proc = cluster.procs["decode"][0]
    proc.kill()
    proc.wait(30)
    before = scrape(cluster.proxy)
    r = httpx.post(f"{cluster.proxy}/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == reference(cluster)
    with httpx.stream("POST", f"{cluster.proxy}/v1/completions", json=BODY | {"stream": True}, timeout=60) as s:
        events = sse_events(s.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == r.json()["choices"][0]["text"]
    assert delta(before, scrape(cluster.proxy), "dspark:proxy_requests_total", "prefill_only") == 2
    assert "the prefill instance serves the whole request" in caplog.text
    assert "to http://127.0.0.1" in cluster.log("prefill") and "failed (ConnectError" in cluster.log("prefill")
    assert httpx.get(f"{cluster.prefill}/health").status_code == 200
    assert httpx.get(f"{cluster.proxy}/health").status_code == 503  # says which instance is down
    assert httpx.get(f"{cluster.proxy}/v1/models").json()["data"][0]["id"] == "target"  # the prefill instance's
