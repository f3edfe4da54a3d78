"""The command line as a user runs it (issue 31), part 1: ``--version``, ``check`` on a missing model, a broken
drafter and a bundled one, and bundled names as model references. Each behaviour runs once as a user would
(``python -m dspark.cli`` in a fresh process with fresh caches, tests/cli_helpers.py); its variants run in-process
(``main``) to keep the file fast. Part 2: test_cli_generate.py; part 3: test_cli_tools.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_helpers import run
from dspark.checkpoint.resolve import BUNDLED, BUNDLED_DIR, locate_model
from dspark.cli import main
from dspark.config import ConfigError
from dspark.llm import resolve_model

K3_DRAFT = BUNDLED_DIR / "k3-mini-dspark"


def test_version_names_dspark_torch_and_the_cpu(tmp_path: Path) -> None:
    import torch

    import dspark

    p = run(tmp_path, "--version")
    assert p.returncode == 0, p.stderr
    line = p.stdout.strip()
    assert line.startswith(f"dspark {dspark.__version__} ") and len(line.splitlines()) == 1
    assert f"torch {torch.__version__}" in line
    assert f"CPU capability {torch.backends.cpu.get_cpu_capability()}" in line


def test_check_a_missing_model_prints_the_reference_and_how_to_fetch_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    p = run(tmp_path, "check", "no/such-model")
    assert p.returncode == 1
    problem = [line for line in p.stdout.splitlines() if "✖ model-reference:" in line]
    assert len(problem) == 1 and "'no/such-model'" in problem[0]
    assert "huggingface-cli download no/such-model" in p.stdout and "fix: fetch it" in p.stdout
    assert "[1/6]" not in p.stdout  # no step list of checks that never ran
    assert p.stdout.rstrip().endswith("✖ 1 problem in 1 of 1 checks: nothing else could be checked")

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "modelscope"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert main(["check", "no-such-name"]) == 1
    out = capsys.readouterr().out
    assert "'no-such-name': no such file or directory" in out and "kimi-k3-mini-dspark" in out
    assert "fix: check the spelling" in out
    assert main(["check", "no/such-model", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert [(x["check"], bool(x["message"]), bool(x["fix"])) for x in report["problems"]] == [
        ("model-reference", True, True)
    ]


def test_check_a_broken_drafter_prints_the_failing_check_and_its_fix(tmp_path: Path) -> None:
    bad = tmp_path / "bad-draft"
    bad.mkdir()
    for f in K3_DRAFT.iterdir():
        (bad / f.name).symlink_to(f)
    config = json.loads((K3_DRAFT / "config.json").read_text())
    depth = config["target_num_hidden_layers"]
    config["target_layer_ids"] = [*config["target_layer_ids"][:-1], depth + 5]  # past the target's last layer
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(config))

    p = run(tmp_path, "check", str(bad), "--target", "k3-mini")
    assert p.returncode == 1
    failing = [line for line in p.stdout.splitlines() if line.lstrip().startswith("✖ target-layer-ids:")]
    assert failing and all(" – fix: " in line for line in failing)
    assert str(depth + 5) in failing[0]
    assert "✔ roster:" in p.stdout and "✔ yarn:" in p.stdout  # the other checks still ran and say so
    assert "problem" in p.stdout.splitlines()[-1]


def test_check_a_bundled_drafter_by_name_passes_with_its_target(tmp_path: Path) -> None:
    p = run(tmp_path, "check", "kimi-k3-mini-dspark")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "✖" not in p.stdout
    assert "its target kimi-k3-mini" in p.stderr
    assert "✔ hidden-size:" in p.stdout  # a pairing check: it ran against the target
    assert "skipped" not in p.stdout.splitlines()[-1]
    assert p.stdout.rstrip().endswith("checks passed")


def test_every_bundled_model_is_a_model_reference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the registry covers every model directory shipped under assets/, and each name resolves to its directory
    shipped = {d.name for d in BUNDLED_DIR.iterdir() if (d / "config.json").is_file()}
    assert shipped == {n for n, m in BUNDLED.items() if m.available} and len(shipped) >= 6
    for name in sorted(shipped):
        assert locate_model(name).path == BUNDLED_DIR / name
        assert main(["roster", name, "--json"]) == 0, name
        assert json.loads(capsys.readouterr().out)["num_params"] > 0
    with pytest.raises(ConfigError, match="drafter of 'k3-mini', not a target.*--model k3-mini"):
        resolve_model("k3-mini-dspark")
    # as a user types one
    p = run(tmp_path, "roster", "kimi-k3-mini-dspark")
    assert p.returncode == 0 and "parameters" in p.stdout.splitlines()[-1], p.stderr


def test_json_option_type_reads_files_and_inline_json(tmp_path: Path) -> None:
    import argparse

    from dspark.cli_common import json_object

    (tmp_path / "s.json").write_text('{"method": "ngram"}')
    assert json_object(f"@{tmp_path / 's.json'}") == {"method": "ngram"} == json_object('{"method": "ngram"}')
    with pytest.raises(argparse.ArgumentTypeError, match="cannot read"):
        json_object(f"@{tmp_path / 'none.json'}")
