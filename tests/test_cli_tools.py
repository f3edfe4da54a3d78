"""The command line as a user runs it (issue 31), part 3: ``train-target --tiny`` from an empty directory (it builds
its own small corpus and tokenizer) and ``verify-lossless`` testing the dtype and weights ``generate`` runs by
default ("auto" for both), saying which."""

from __future__ import annotations

import json
from pathlib import Path

from cli_helpers import run


def test_the_tiny_smoke_path_runs_from_an_empty_directory(tmp_path: Path) -> None:
    """train-target --tiny, draft-data --tiny, train-draft --tiny, check, generate: each as a user runs it."""
    p = run(tmp_path, "train-target", "--tiny", "--quiet", "--json")
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)
    assert result["steps"] == 30 and result["val_loss"] is not None
    export = tmp_path / result["export_dir"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.name for f in export.iterdir()}
    assert (tmp_path / "runs" / "data" / "tiny" / "train.npy").is_file()
    assert "building a small corpus" in p.stderr

    # the drafter's smoke path continues from there, each step finding what the one before wrote (docs/training.md)
    p = run(tmp_path, "draft-data", "--tiny", "--quiet", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["train_samples"] > 0 and (tmp_path / "runs" / "tiny-draft-data" / "train.npz").is_file()
    p = run(tmp_path, "train-draft", "--tiny", "--quiet", "--json")
    assert p.returncode == 0, p.stderr
    draft = tmp_path / json.loads(p.stdout)["export_dir"]
    p = run(tmp_path, "check", str(draft), "--target", str(export))
    assert p.returncode == 0 and "checks passed" in p.stdout, p.stdout + p.stderr
    spec = json.dumps({"method": "dspark", "model": str(draft)})
    p = run(tmp_path, "generate", "def add(a, b):", "--model", str(export), "--speculative-config", spec,
            "--max-tokens", "8", "--no-compare", "--json")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["num_output_tokens"] == 8
    p = run(tmp_path, "train-draft", "--tiny", "--quiet")  # a second smoke run replaces the first
    assert p.returncode == 0 and "replacing the earlier smoke run" in p.stderr, p.stderr


def test_verify_lossless_tests_generates_default_dtype_and_says_which(tmp_path: Path) -> None:
    from dspark.cli import build_parser
    from dspark.config import EngineConfig
    from dspark.precision import cpu_capability, cpu_flags, native_bf16

    parser = build_parser()
    generate, verify = parser.parse_args(["generate"]), parser.parse_args(["verify-lossless", "--dataset", "d"])
    assert generate.dtype == verify.dtype == EngineConfig.dtype == "auto"
    assert generate.quantization == verify.quantization == EngineConfig.quantization == "auto"
    expected = "bfloat16" if native_bf16(cpu_flags(), cpu_capability())[0] else "float32"  # k3-mini is dense
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n")
    p = run(
        tmp_path,
        "verify-lossless",
        "--model",
        "k3-mini",
        "--dataset",
        str(prompts),
        "--num-prompts",
        "1",
        "--max-tokens",
        "8",
    )
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert f"dtype {expected} (auto: " in lines[0] and "quantization none (auto: not the export" in lines[0]
    assert "every step drafting (speculation guard off)" in lines[0]
    assert lines[-1] == f"verify-lossless ({expected}, quantization none): identical"
