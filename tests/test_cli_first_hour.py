"""The command line as a newcomer meets it, part 4 (parts 1-3: test_cli_commands.py, test_cli_generate.py,
test_cli_tools.py): ``dspark check`` given a target instead of a drafter (a bundled target checks its shipped
drafter; any other target is one problem naming the fix, not a cascade of drafter-key errors), ``train-target``
without prepared data (the commands that build it, before anything loads), ``serve --threads`` and ``serve
--speculative-config @file``, and the one version number. User-facing behaviours run in a fresh process with
fresh caches (tests/cli_helpers.py)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

import dspark
from cli_helpers import run
from dspark.checkpoint.resolve import BUNDLED_DIR
from dspark.cli import build_parser, main

REPO = Path(__file__).resolve().parent.parent


def test_check_a_bundled_target_checks_its_shipped_drafter(tmp_path: Path) -> None:
    p = run(tmp_path, "check", "k3-mini")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "k3-mini is a target with a shipped drafter: checking k3-mini-dspark" in p.stderr
    assert "✖" not in p.stdout and "✔ hidden-size:" in p.stdout  # the pairing checks ran against k3-mini
    assert p.stdout.rstrip().endswith("checks passed")


def test_check_a_target_given_as_draft_is_one_problem_with_its_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "some-target"  # k3-mini's files under another name: a target dspark ships no drafter for
    target.mkdir()
    for f in (BUNDLED_DIR / "k3-mini").iterdir():
        (target / f.name).symlink_to(f)
    assert main(["check", str(target), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [x["check"] for x in report["problems"]] == ["draft-config"], report["problems"]
    problem = report["problems"][0]
    assert "DeepseekV3ForCausalLM" in problem["message"] and "is a target model's config" in problem["message"]
    assert f"dspark check DRAFT --target {target}" in problem["fix"]

    # with a drafter as DRAFT and this model as --target, the pair passes
    assert main(["check", str(BUNDLED_DIR / "k3-mini-dspark"), "--target", str(target), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_train_target_without_data_names_the_commands_that_build_it(tmp_path: Path) -> None:
    p = run(tmp_path, "train-target", "--quiet")
    assert p.returncode == 1
    err = p.stderr.strip()
    assert err.startswith("dspark train-target: error: runs/data/bpe8k has no train.npy / validation.npy"), err
    assert "python -m dspark.train.corpus runs/data/corpus" in err
    assert "python -m dspark.train.tokenizer runs/data/corpus runs/data/bpe8k --vocab-size 8192" in err
    assert "dspark train-target --tiny" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_serve_takes_threads_and_spec_files_like_generate(tmp_path: Path) -> None:
    parser = build_parser()
    assert parser.parse_args(["serve", "--threads", "2"]).threads == 2
    assert parser.parse_args(["serve"]).threads is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--threads", "0"])
    spec = {"method": "dspark", "model": "k3-mini-dspark"}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert parser.parse_args(["serve", "--speculative-config", f"@{tmp_path / 'spec.json'}"]).speculative_config == spec
    with pytest.raises(SystemExit):  # refused while parsing, before any model loads
        parser.parse_args(["serve", "--speculative-config", f"@{tmp_path / 'missing.json'}"])


def test_one_version_number() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["version"] == dspark.__version__
