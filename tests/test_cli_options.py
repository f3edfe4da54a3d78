"""One CLI: every subcommand is registered through one table (``dspark.cli.SUBCOMMANDS``), and each option several
subcommands share is defined once, in ``dspark.cli_common`` (a subcommand calls ``add_model_arg``,
``add_speculative_config_arg``, ``add_seed_arg``, ``add_max_tokens_arg`` or ``add_threads_arg``)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import dspark
import dspark.cli as cli
from dspark.cli_common import SHARED_OPTIONS

PACKAGE = Path(dspark.__file__).resolve().parent


def option_definitions(source: str) -> list[tuple[str, int]]:
    """(option, line) for every shared option string passed to an ``add_argument`` call or used as a dict key (a table
    of flags) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            strings = [a for a in node.args if isinstance(a, ast.Constant)]
        elif isinstance(node, ast.Dict):
            strings = [k for k in node.keys if isinstance(k, ast.Constant)]
        else:
            continue
        found += [(s.value, s.lineno) for s in strings if s.value in SHARED_OPTIONS]
    return found


def test_the_finder_sees_a_definition():
    src = (
        'p.add_argument("--seed", type=int)\nFLAGS = {"--max-tokens": ("max_tokens", int, "")}\n'
        'g.add_argument("-m", "--model")\n'
    )
    assert option_definitions(src) == [("--seed", 1), ("--max-tokens", 2), ("--model", 3)]
    assert option_definitions('p.add_argument("--seed-file")\nset_threads(n, "--threads")\n') == []


def test_shared_options_are_defined_only_in_cli_common():
    elsewhere = [
        f"{f.relative_to(PACKAGE)}:{line} {opt}"
        for f in sorted(PACKAGE.rglob("*.py"))
        if f.name != "cli_common.py"
        for opt, line in option_definitions(f.read_text())
    ]
    assert elsewhere == []


def test_one_subcommand_registry():
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == set(cli.SUBCOMMANDS)


@pytest.mark.parametrize("command", ["generate", "verify-lossless", "calibrate"])
def test_speculative_config_is_parsed_once_by_the_parser(command, tmp_path):
    """Every --speculative-config is a JSON object by the time the command sees it, from inline JSON or @file."""
    f = tmp_path / "spec.json"
    f.write_text(json.dumps({"method": "ngram", "num_speculative_tokens": 3}))
    extra = ["--dataset", "x.jsonl"] if command != "generate" else []
    for value in (f.read_text(), f"@{f}"):
        args = cli.build_parser().parse_args([command, *extra, "--speculative-config", value])
        assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "profile", "train-target", "train-draft"])
def test_threads_take_only_positive_counts(command, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([command, "--threads", "0"])
    assert "positive integer" in capsys.readouterr().err
