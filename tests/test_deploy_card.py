"""The model card's deployment line, run as written: the bundled drafter sits in a Hugging Face cache laid out by
the test under its official id, and ``dspark serve <target> --speculative-config '<the card's JSON>'`` starts,
says once which attention backend runs instead of FLASHINFER_MLA, serves, and reports acceptance."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dspark.llm import BUNDLED_DRAFT, BUNDLED_TARGET, bundled_available

CARD = (
    '{"method": "dspark", "model": "Inferact/Kimi-K3-DSpark", "num_speculative_tokens": 7, '
    '"attention_backend": "FLASHINFER_MLA"}'
)
COMMIT = "cf6b8244620e7ea4b0651d214f28e89eac75bed6"  # the pinned official revision (the files are ours)

pytestmark = pytest.mark.skipif(not bundled_available(), reason="needs the bundled k3-mini pair")


def hf_cache_with_bundled_drafter(home: Path) -> Path:
    repo = home / "hub" / "models--Inferact--Kimi-K3-DSpark"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in sorted(BUNDLED_DRAFT.iterdir()):
        blob = repo / "blobs" / f.name  # real caches name blobs by hash; the snapshot links are what matter
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def counters(url: str) -> dict[str, float]:
    """Prometheus samples summed over their labels (model name, engine), per-position ones left out."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "position" not in s.labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_card_command_line_serves_from_the_hf_cache_and_reports_acceptance(tmp_path: Path):
    hf_cache_with_bundled_drafter(tmp_path / "hf")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    port = free_port()
    cmd = [sys.executable, "-m", "dspark.cli", "serve", str(BUNDLED_TARGET), "--speculative-config", CARD]
    cmd += ["--port", str(port), "--max-num-seqs", "2", "--log-level", "warning"]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"dspark serve exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"dspark serve did not come up:\n{log.read_text()}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        r = api.completions.create(
            model=api.models.list().data[0].id, prompt="def add(a, b):\n", max_tokens=32, temperature=0
        )
        spec = r.model_extra["metrics"]["speculative_decoding"]
        assert spec["num_spec_steps"] > 0 and spec["mean_acceptance_length"] > 1.0
        c = counters(url)
        assert c["vllm:spec_decode_num_drafts_total"] == spec["num_spec_steps"]
        assert c["vllm:spec_decode_num_accepted_tokens_total"] > 0
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert text.count("BackendSubstitutionWarning") == 1 and "FLASHINFER_MLA" in text and "'sdpa'" in text
    assert "speculation: dspark" in text


def test_serve_takes_the_model_positionally_and_refuses_two_different_ones(capsys: pytest.CaptureFixture[str]):
    from dspark.cli import build_parser, main

    args = build_parser().parse_args(["serve", "Org/Model@v1", "--port", "9"])
    assert args.model_positional == "Org/Model@v1" and args.model is None
    assert build_parser().parse_args(["serve", "--model", "d"]).model == "d"  # --model stays
    assert main(["serve", "a", "--model", "b"]) == 1
    assert "MODEL 'a' and --model 'b' differ" in capsys.readouterr().err
