"""The command line as a user runs it (issue 31), part 2: ``dspark generate`` with ``--speculative-config @file``
naming a bundled drafter, the chat template (applied by default when the target's tokenizer has one, raw for base
models pretrained on raw text and with ``--no-chat-template``; ``--json`` says which), and the CPU thread choice
(one stderr line while it measures, cached under ``$DSPARK_CACHE``, skipped by ``--threads`` or
``DSPARK_NUM_THREADS``). Behaviours run once in a fresh process (tests/cli_helpers.py), variants in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli_helpers import run
from dspark import threads
from dspark.checkpoint.resolve import BUNDLED_DIR
from dspark.cli import main

PROMPT = "Write a function that adds two numbers."


def test_speculative_config_from_a_file_with_a_bundled_drafter_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = {"method": "dspark", "model": "k3-mini-dspark", "num_speculative_tokens": 3}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    argv = ["generate", "def add(a, b):", "--model", "k3-mini", "--max-tokens", "6", "--no-compare"]
    p = run(tmp_path, *argv, "--speculative-config", "@spec.json", "--dtype", "float32")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("def add(a, b):") and "error" not in p.stderr
    assert "speculation: dspark" in p.stderr

    # refused while parsing (exit 2, argparse's usage error), naming the file, before any model loads
    (tmp_path / "broken.json").write_text("{method: dspark}")
    for value, expected in (
        (f"@{tmp_path / 'missing.json'}", "missing.json"),
        (f"@{tmp_path / 'broken.json'}", "not valid JSON in "),
        ("[1, 2]", "expected a JSON object"),
    ):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--speculative-config", value])
        assert e.value.code == 2 and expected in capsys.readouterr().err


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """k3-mini as any downloaded model: its files (chat template included) without dspark's pretraining log."""
    d = tmp_path_factory.mktemp("chat-model")
    for f in (BUNDLED_DIR / "k3-mini").iterdir():
        if f.name != "training_log.json":
            (d / f.name).symlink_to(f)
    return d


def _generate_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["generate", PROMPT, "--no-spec", "--json", "--max-tokens", "4", "--threads", "1", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_applies_the_chat_template_by_default_and_says_so(
    tmp_path: Path, chat_target: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dspark.llm import LLM
    from dspark.sampling_params import SamplingParams

    monkeypatch.setattr(threads, "_explicit", threads.is_explicit())  # --threads below sets it; restore after
    p = run(tmp_path, "generate", PROMPT, "--model", str(chat_target), "--no-spec", "--json", "--max-tokens", "4")
    assert p.returncode == 0, p.stderr
    cli = json.loads(p.stdout)
    assert cli["chat_template"] is True and "chat template" in cli["prompt_format"]

    # oracle: the same target through the Python API, prompted with the chat template's ids, or with the raw text
    llm = LLM(chat_target, None)
    tok = llm.engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=4)
    chat_ids = tok.encode_chat([{"role": "user", "content": PROMPT}])
    assert chat_ids[: len(tok.encode(PROMPT))] != tok.encode(PROMPT)  # the template changes the prompt
    assert cli["token_ids"] == llm.generate(chat_ids, params)[0].token_ids
    raw = _generate_json(capsys, "--model", str(chat_target), "--no-chat-template")
    assert raw["chat_template"] is False and raw["prompt_format"] == "--no-chat-template"
    assert raw["token_ids"] == llm.generate(PROMPT, params)[0].token_ids

    # the bundled targets are base models pretrained on raw code: raw by default, the template only with --chat
    base = _generate_json(capsys, "--model", "k3-mini")
    assert base["chat_template"] is False and "base model pretrained on raw text" in base["prompt_format"]
    assert base["token_ids"] == raw["token_ids"]  # the same weights, the same raw prompt
    forced = _generate_json(capsys, "--model", "k3-mini", "--chat")
    assert forced["chat_template"] is True and forced["token_ids"] == cli["token_ids"]


def test_thread_calibration_says_so_is_cached_and_can_be_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSPARK_CACHE", str(cache))
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "_explicit", False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)  # something to choose between, on any machine
    measured: list[list[int]] = []

    def calibrate(workload, counts, repeats=7):  # the timings, without spending them
        measured.append(list(counts))
        return {n: 0.01 * n for n in counts}

    monkeypatch.setattr(threads, "calibrate", calibrate)
    argv = ["generate", "x", "--model", "k3-mini", "--no-spec", "--json", "--max-tokens", "2"]
    before = torch.get_num_threads()
    try:
        assert main(argv) == 0
        err = capsys.readouterr().err
        said = [line for line in err.splitlines() if "CPU threads" in line]
        assert len(said) == 1 and "--threads N" in said[0] and f"{threads.ENV}=N" in said[0]
        assert str(cache / "threads.json") in said[0] and measured == [[1, 2]]
        assert [v["threads"] for v in json.loads((cache / "threads.json").read_text()).values()] == [1]

        assert main(argv) == 0  # cached: not measured again, nothing said
        assert measured == [[1, 2]] and "CPU threads" not in capsys.readouterr().err

        (cache / "threads.json").unlink()
        monkeypatch.setenv(threads.ENV, "1")
        assert main(argv) == 0
        assert measured == [[1, 2]] and not (cache / "threads.json").exists()
        monkeypatch.setenv(threads.ENV, "zero")
        assert main(argv) == 1 and f"{threads.ENV}='zero'" in capsys.readouterr().err

        monkeypatch.delenv(threads.ENV)
        assert main([*argv, "--threads", "1"]) == 0
        assert measured == [[1, 2]] and not (cache / "threads.json").exists()
        assert torch.get_num_threads() == 1
        with pytest.raises(SystemExit):
            main([*argv, "--threads", "0"])
        assert "expected a positive integer" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_the_kv_report_adds_the_models_whole_window(capsys: pytest.CaptureFixture[str]) -> None:
    """The default pair serves 131,072 positions while the engine starts for 32,768: generate reports a
    16,384-token request and one of the whole window, saying how to serve it."""
    assert main(["generate", "def f(x):", "--max-tokens", "2", "--no-compare", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "a 16384-token request: target latents" in err
    assert "a 131072-token request: target latents" in err and "serve it with --max-model-len 131072" in err
