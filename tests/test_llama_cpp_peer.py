"""llama.cpp as a bench peer: its perf lines are parsed (the first token comes from the prompt's evaluation), a missing
binary is named with the fix, the command carries our sampling settings and thread count, our prompt ids go in as
text with their special tokens, and only GGUF-exported targets get the method. The real tool is measured by
``dspark bench --llama-cpp-bin`` (docs/peers.md), not here: a stand-in script plays it."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from dspark.bench.llama_cpp import LlamaCppError, LlamaCppMethod, find_binary, parse_perf
from dspark.sampling_params import SamplingParams

LOG = """\
I common_perf_print:    sampling time =       9.20 ms
I common_perf_print:    samplers time =       4.32 ms /    85 tokens
I common_perf_print:        load time =     201.87 ms
I common_perf_print: prompt eval time =     213.02 ms /    21 tokens (   10.14 ms per token,    98.58 tok/s)
I common_perf_print:        eval time =    1432.95 ms /    63 runs   (   22.75 ms per token,    43.97 tok/s)
I common_perf_print:       total time =    1688.83 ms /    84 tokens
"""


def test_perf_lines_parse_and_load_time_is_left_out() -> None:
    p = parse_perf("model output\n" + LOG)
    assert (p.prompt_tokens, p.eval_runs, p.output_tokens) == (21, 63, 64)
    assert p.wall_s == pytest.approx((213.02 + 1432.95 + 9.20) / 1000)
    with pytest.raises(LlamaCppError, match="no 'prompt time' line"):
        parse_perf(LOG.replace("prompt eval", "prompt xval"))


def test_a_missing_binary_names_the_folder_and_the_build_doc(tmp_path) -> None:
    with pytest.raises(LlamaCppError, match=r"no llama-completion.*docs/peers.md"):
        find_binary(tmp_path)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-completion").write_text("")
    assert find_binary(tmp_path) == tmp_path / "bin" / "llama-completion"


def fake_llama(tmp_path: Path, runs: int) -> Path:
    """A stand-in llama-completion: records its arguments, prints perf lines as llama.cpp does."""
    record = tmp_path / "args.jsonl"
    script = tmp_path / "llama-completion"
    log = LOG.replace("63 runs", f"{runs} runs")
    script.write_text(
        "#!/usr/bin/env python3\nimport json, sys\n"
        f"open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"sys.stderr.write({log!r})\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def test_the_method_runs_one_process_per_prompt_with_our_settings(tmp_path) -> None:
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    vocab = {"<|im_start|>": 0, "a": 1, "b": 2}
    (tok_dir / "tokenizer.json").write_text(
        json.dumps(
            {
                "version": "1.0",
                "added_tokens": [
                    {
                        "id": 0,
                        "content": "<|im_start|>",
                        "single_word": False,
                        "lstrip": False,
                        "rstrip": False,
                        "normalized": False,
                        "special": True,
                    }
                ],
                "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "a"},
            }
        )
    )
    fake = fake_llama(tmp_path, runs=7)
    m = LlamaCppMethod("llama-cpp", fake, tmp_path / "model.gguf", tok_dir, threads=1, seed=3)
    assert m.skip_reason(2, 0.0) and m.skip_reason(1, 0.0) is None
    got = m.run([[0, 1, 2], [0, 2]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert got.output_tokens == 2 * 8 and got.requests == 2 and got.counters is None
    # its phases from its own counters: 2 × 21 prompt tokens in 2 × 213.02 ms, 2 × 7 eval runs in 2 × 1432.95 ms
    assert (got.prefill.tokens, got.decode.steps) == (42, 14)
    assert got.prefill.total_s == pytest.approx(0.42604) and got.decode.total_s == pytest.approx(2.8659)
    calls = [json.loads(line) for line in (tmp_path / "args.jsonl").read_text().splitlines()]
    first = calls[0]
    assert first[first.index("-m") + 1] == str(tmp_path / "model.gguf") and first[first.index("-t") + 1] == "1"
    assert first[first.index("-n") + 1] == "8" and first[first.index("--temp") + 1] == "0.0"
    assert "--ignore-eos" in first and first[first.index("-s") + 1] == "3" and calls[1][calls[1].index("-s") + 1] == "4"
    assert first[first.index("-p") + 1].startswith("<|im_start|>")  # special tokens kept in the text
    assert "re-tokenized to another length" in m.notes()[0]  # the stand-in always reports 21 prompt tokens


def test_only_a_gguf_export_gets_the_llama_cpp_method(tmp_path) -> None:
    from dspark.bench.speed import BenchConfig, Resolved, method_names

    res = Resolved(tmp_path, None, None, False, False)
    notes: list[str] = []
    names = method_names(BenchConfig("d.jsonl", baselines=(), llama_cpp_bin=str(tmp_path)), res, notes)
    assert names == ["ar"] and any("not exported from a GGUF file" in n for n in notes)
