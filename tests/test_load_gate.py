"""generate / serve / LLM / build_engines refuse, with the doctor's message, what `dspark check` rejects: a draft
whose YaRN factor or rope_theta differs from the target's, NaN/Inf weights, a target without tokenizer.json
(only explicitly random test weights run on bytes), a dtype relabelled in a safetensors header, a target missing
a tensor. Each was served silently before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.cli import main
from dspark.doctor import LOAD_CHECKS, run_checks
from dspark.doctor.gate import LoadRefused
from dspark.llm import LLM, build_engines, engine_configs
from dspark.models.tiny import write_tiny_pair
from dspark.sampling_params import SamplingParams
from test_doctor import relabel, to_bf16, write_tokenizer


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pair")
    target, _ = write_tiny_pair(root)
    write_tokenizer(target)
    return root


@pytest.fixture
def pair(base: Path, tmp_path: Path) -> tuple[Path, Path]:
    shutil.copytree(base, tmp_path / "pair")
    return tmp_path / "pair" / "target", tmp_path / "pair" / "draft"


def spec(draft: Path) -> dict[str, object]:
    return {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3}


def edit_config(d: Path, **changes: object) -> None:
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


def poke(d: Path, name: str, value: float) -> None:
    state = load_file(d / "model.safetensors")
    state[name].view(-1)[0] = value
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})


def refused(target: Path, cfg: dict[str, object] | None) -> str:
    with pytest.raises(LoadRefused) as e:
        build_engines(target, [cfg], *engine_configs(dtype="float32"))
    return str(e.value)


def test_clean_pair_loads_and_generates(pair):
    target, draft = pair
    out = LLM(target, spec(draft), dtype="float32").generate("w5 w6", SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].token_ids) == 4


@pytest.mark.parametrize(
    ("key", "value"), [("factor", 8.0), ("original_max_position_embeddings", 4096), ("rope_theta", 50000.0)]
)
def test_draft_rope_differing_from_the_target_is_refused(pair, key, value):
    target, draft = pair
    rope = json.loads((draft / "config.json").read_text())["rope_parameters"]
    edit_config(draft, rope_parameters=rope | {key: value})
    msg = refused(target, spec(draft))
    assert "[yarn]" in msg and key in msg and str(draft / "config.json") in msg


def test_rope_theta_differs_without_yarn(pair):
    target, draft = pair
    edit_config(target, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_theta=10000.0)
    edit_config(draft, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rope_theta=500000.0)
    assert "rope_theta differs: draft 500000.0 vs target 10000.0" in refused(target, spec(draft))


@pytest.mark.parametrize("who", ["draft", "target"])
def test_nan_or_inf_weights_are_refused(pair, who):
    target, draft = pair
    if who == "draft":
        poke(draft, "layers.0.mlp.up_proj.weight", float("nan"))
    else:
        poke(target, "model.layers.0.self_attn.o_proj.weight", float("inf"))
    msg = refused(target, spec(draft))
    assert "NaN/Inf" in msg and ("up_proj" in msg if who == "draft" else "o_proj" in msg)


def test_target_without_tokenizer_is_refused_unless_marked_random(pair):
    target, draft = pair
    (target / "tokenizer.json").unlink()
    edit_config(target, dspark_random_weights=None)
    msg = refused(target, None)  # also without speculation
    assert "[tokenizer]" in msg and f"no tokenizer.json in the target directory {target}" in msg
    edit_config(target, dspark_random_weights=True)
    (engine,) = build_engines(target, [None], *engine_configs(dtype="float32"))  # random test weights: bytes stand in
    assert engine.tokenizer is not None


def test_dtype_relabelled_in_the_header_is_refused(pair):
    target, draft = pair
    to_bf16(draft)
    relabel(draft / "model.safetensors", "layers.1.mlp.gate_proj.weight", "F16")
    msg = refused(target, spec(draft))
    assert "[dtype]" in msg and "layers.1.mlp.gate_proj.weight" in msg


def test_target_missing_a_tensor_is_refused_with_the_doctors_message(pair):
    target, draft = pair
    state = load_file(target / "model.safetensors")
    del state["model.layers.1.mlp.gate.weight"]
    save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    assert "[target-roster] missing tensor 'model.layers.1.mlp.gate.weight'" in refused(target, None)


def test_generate_cli_exits_1_with_the_message(pair, capsys: pytest.CaptureFixture[str]):
    target, draft = pair
    poke(draft, "final_norm.weight", float("nan"))
    rc = main(["generate", "w5", "--model", str(target), "--speculative-config", json.dumps(spec(draft))])
    err = capsys.readouterr().err
    assert rc == 1 and "refusing to load" in err and "final_norm.weight" in err


def test_finite_scan_is_one_pass_over_loaded_weights(pair, monkeypatch: pytest.MonkeyPatch):
    """The load-time NaN scan reads the weights in memory, never the files again (the doctor's bf16 scan)."""
    target, draft = pair
    assert "bf16" not in LOAD_CHECKS
    calls = []
    real = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: calls.append(t.numel()) or real(t))
    build_engines(target, [spec(draft)], *engine_configs(dtype="float32"))
    assert calls  # one isfinite per loaded tensor


def test_hf_target_missing_a_tensor_is_refused(tmp_path: Path):
    """transformers would initialize the missing tensor at random and only warn; the doctor lists it."""
    from test_hf_target import tiny_qwen3

    target, draft = tiny_qwen3(tmp_path)
    assert "target-roster" in run_checks(draft, target).passed  # transformers' roster was compared
    state = load_file(target / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    msg = refused(target, spec(draft))
    assert "[target-roster] missing tensor 'model.layers.1.mlp.down_proj.weight'" in msg
