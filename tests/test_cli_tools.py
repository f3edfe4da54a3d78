"""The command line as a user runs it (issue 31), part 3: ``train-target --tiny`` from an empty directory (it builds
its own small corpus and tokenizer) and ``verify-lossless`` testing the dtype ``generate`` runs by default."""

from __future__ import annotations

import json
from pathlib import Path

from cli_helpers import run


def test_train_target_tiny_runs_from_an_empty_directory(tmp_path: Path) -> None:
    p = run(tmp_path, "train-target", "--tiny", "--quiet", "--json")
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)
    assert result["steps"] == 30 and result["val_loss"] is not None
    export = tmp_path / result["export_dir"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.name for f in export.iterdir()}
    assert (tmp_path / "runs" / "data" / "tiny" / "train.npy").is_file()
    assert "building a small corpus" in p.stderr


def test_verify_lossless_tests_generates_default_dtype_and_says_which(tmp_path: Path) -> None:
    from dspark.cli import DEFAULT_DTYPE, build_parser

    generate = build_parser().parse_args(["generate"])
    assert generate.dtype == DEFAULT_DTYPE == "bfloat16"
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
    assert "dtype bfloat16 (generate's default" in lines[0]
    assert lines[-1] == "verify-lossless (bfloat16): identical"
