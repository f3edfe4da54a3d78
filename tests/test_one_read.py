"""One route for a model: within one command (``generate``, ``bench``, ``serve``, ``check``) each model's config.json
is opened once, however many layers look at the model (the resolver, the doctor's load gate, the precision choice,
the loader, the tokenizer, the bench's transformers baselines). Counted at the file opens themselves, transformers'
included; the commands run in-process on the bundled models."""

from __future__ import annotations

import builtins
import io
import json
import os
from collections import Counter
from pathlib import Path

import pytest

from dspark.checkpoint.resolve import BUNDLED_DRAFT, BUNDLED_TARGET, MLA_DFLASH, MLA_DRAFT, MLA_TARGET
from dspark.cli import main


@pytest.fixture
def config_opens(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Counter[str]:
    """Every open of a file named config.json from now on, by model directory name."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "dspark-cache"))
    opens: Counter[str] = Counter()
    real_open = io.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, str | os.PathLike) and os.path.basename(os.fspath(file)) == "config.json":
            opens[Path(os.path.realpath(file)).parent.name] += 1
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", counting_open)  # pathlib opens through io.open
    monkeypatch.setattr(builtins, "open", counting_open)  # transformers through open
    return opens


def names(*dirs: Path) -> dict[str, int]:
    return {d.name: 1 for d in dirs}


def test_generate_reads_each_config_once(config_opens: Counter[str], capsys: pytest.CaptureFixture[str]) -> None:
    # --json compares with plain decoding: two engines on one target, the drafter, the doctor's gate before both
    assert main(["generate", "def add(a, b):", "--max-tokens", "4", "--json", "--threads", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["acceptance_length"] is not None
    assert dict(config_opens) == names(BUNDLED_TARGET, BUNDLED_DRAFT)


def test_bench_reads_each_config_once(
    config_opens: Counter[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # k3-mini: every engine method (dspark, dflash, ngram, ...) plus transformers' generate on the same target
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "k3-mini", "--dataset", str(tmp_path / "prompts.jsonl"), "--output", str(out)]
    assert main([*argv, "--num-prompts", "1", "--max-tokens", "4", "--no-warmup", "--quiet"]) == 0
    methods = json.loads(out.read_text())["config"]["methods"]
    assert {"dspark", "dflash", "hf-generate"} <= set(methods)
    assert dict(config_opens) == names(MLA_TARGET, MLA_DRAFT, MLA_DFLASH)


def test_serve_reads_each_config_once(config_opens: Counter[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi.testclient import TestClient

    apps = []
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: apps.append(app))
    monkeypatch.delenv("DSPARK_API_KEY", raising=False)
    assert main(["serve", "--port", "8000"]) == 0
    assert dict(config_opens) == names(BUNDLED_TARGET, BUNDLED_DRAFT)
    with TestClient(apps[0]) as client:  # serving a request reads no model file again
        r = client.post("/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert dict(config_opens) == names(BUNDLED_TARGET, BUNDLED_DRAFT)


def test_check_reads_each_config_once(config_opens: Counter[str], capsys: pytest.CaptureFixture[str]) -> None:
    # a bundled drafter is checked with its own target; the precision line reads the target too
    assert main(["check", BUNDLED_DRAFT.name, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    assert dict(config_opens) == names(BUNDLED_TARGET, BUNDLED_DRAFT)


def test_one_spec_per_model_within_a_command_and_a_fresh_read_outside(tmp_path: Path) -> None:
    from dspark.models.families import DSPARK, MLA, family_of
    from dspark.models.model_spec import model_spec, one_read_per_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    assert model_spec(tmp_path) is not model_spec(tmp_path)  # no command: every call reads, as a plain read would
    with one_read_per_model():
        spec = model_spec(tmp_path)
        with one_read_per_model():  # build_engines inside a bench: the same command
            assert model_spec(str(tmp_path)) is spec and model_spec(tmp_path / "config.json") is spec
        assert spec.family is MLA and spec.is_target
        draft = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3"}  # DeepSpec keeps Qwen3's model_type
        (tmp_path / "config.json").write_text(json.dumps(draft))
        assert model_spec(tmp_path).family is DSPARK  # a rewritten config.json is read again
    assert family_of({}) is MLA and family_of({"model_type": "gpt2"}) is None  # DeepSeek-V3's configs predate the key


def test_the_doctor_checks_a_gqa_target_with_its_loaders_roster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A natively served family is checked natively: a Qwen3 checkpoint with a tensor the strict loader refuses is
    refused by the doctor too (transformers' class would have ignored it), and transformers builds no model."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dspark.checkpoint.io import CheckpointError
    from dspark.doctor import run_checks
    from dspark.models.loading import load_target

    cfg = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    assert load_target(tmp_path, "float32") is not None  # as saved: loads, and the doctor agrees
    monkeypatch.setattr("dspark.doctor.weights._hf_roster", lambda raw: pytest.fail("checked through transformers"))
    assert "target-roster" in run_checks(None, tmp_path).passed

    weights = load_file(tmp_path / "model.safetensors")
    extra = {"model.layers.0.mlp.extra.weight": weights["model.norm.weight"].clone()}
    save_file(weights | extra, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.extra.weight"):
        load_target(tmp_path, "float32")
    (problem,) = [p for p in run_checks(None, tmp_path).problems if p.check == "target-roster"]  # (no tokenizer)
    assert "unexpected tensor 'model.layers.0.mlp.extra.weight'" in problem.message
