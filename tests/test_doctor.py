"""`dspark check` (deployment doctor): a clean tiny pair passes; each fault gives its problem and exit 1."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from dspark.cli import main
from dspark.doctor import CHECKS, CheckReport, format_report, report_json, run_checks
from dspark.models.tiny import tiny_target_config, write_tiny_pair

VOCAB = 96  # tiny_target_config's vocab; ids: bos 0, eos 1, pad 2, mask 3 (tiny_draft_config)
SPECIALS = {"<bos>": 0, "<eos>": 1, "<pad>": 2, "<mask>": 3, "<unk>": 4}
ALL = {c.name for c in CHECKS}
NEED_TARGET = {"target-config", "target-roster", "lm-head", "embedding", "tokenizer", "yarn", "hidden-size", "kv-cache"}


def write_tokenizer(d: Path, **config_overrides: str) -> None:
    vocab = SPECIALS | {f"w{i}": i for i in range(len(SPECIALS), VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(d / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "mask_token": "<mask>"}
    (d / "tokenizer_config.json").write_text(json.dumps(config | config_overrides))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("pair")
    target, _ = write_tiny_pair(root)
    write_tokenizer(target)
    return root


@pytest.fixture
def pair(base: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A fresh copy of the clean pair: (target_dir, draft_dir)."""
    shutil.copytree(base, tmp_path / "pair")
    return tmp_path / "pair" / "target", tmp_path / "pair" / "draft"


def edit_config(d: Path, **changes: object) -> None:
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


def edit_tensors(d: Path, fn: Callable[[dict[str, torch.Tensor]], None], file: str = "model.safetensors") -> None:
    state = load_file(d / file)
    fn(state)
    save_file(state, d / file, metadata={"format": "pt"})


def checks_of(report: CheckReport) -> set[str]:
    return {p.check for p in report.problems}


def messages(report: CheckReport, check: str) -> str:
    return "\n".join(p.message for p in report.problems if p.check == check)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["check", *args])
    return rc, capsys.readouterr().out


# ---------------------------------------------------------------------------------------- clean


def test_clean_pair_passes(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = pair
    report = run_checks(draft, target)
    assert report.ok and report.problems == ()
    assert set(report.passed) == ALL and report.skipped == ()
    rc, out = cli(capsys, str(draft), "--target", str(target))
    assert rc == 0
    assert out.count("✔") == len(ALL) + 1 and "✖" not in out  # one per check + the summary line


def test_draft_only_runs_draft_checks_and_names_the_skipped(
    pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, draft = pair
    report = run_checks(draft)
    assert report.ok
    assert set(report.skipped) == NEED_TARGET
    assert set(report.passed) == ALL - NEED_TARGET
    assert all("--target" in report.skip_reasons[n] for n in report.skipped)
    rc, out = cli(capsys, str(draft))
    assert rc == 0
    for name in NEED_TARGET:
        assert f"{name}: skipped (needs --target" in out


def test_own_lm_head_file_is_checked_without_target(pair: tuple[Path, Path]) -> None:
    _, draft = pair
    save_file({"lm_head.weight": torch.zeros(VOCAB, 32)}, draft / "lm_head.safetensors")
    assert "lm-head" in run_checks(draft).passed
    save_file({"lm_head.weight": torch.zeros(VOCAB, 31)}, draft / "lm_head.safetensors")
    report = run_checks(draft)
    assert checks_of(report) == {"lm-head"}
    assert "[96, 32]" in messages(report, "lm-head")


# ---------------------------------------------------------------------------------------- files


def lfs_pointer(real_size: int = 1234567890) -> bytes:
    text = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{'ab' * 32}\nsize {real_size}\n").encode()
    return text[:135].ljust(135, b"\n")


def test_lfs_pointer_weights_are_reported_not_raised(
    pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    target, draft = pair
    data = lfs_pointer()
    assert len(data) == 135
    (draft / "model.safetensors").write_bytes(data)
    report = run_checks(draft, target)
    assert checks_of(report) == {"lfs-pointers"}  # reported once, not again as a bad safetensors file
    msg = messages(report, "lfs-pointers")
    assert "model.safetensors" in msg and "135 bytes" in msg and "1,234,567,890" in msg
    assert "git lfs pull" in report.problems[0].fix
    assert {"roster", "bf16", "confidence-head", "markov-head"} <= set(report.skipped)
    rc, out = cli(capsys, str(draft), "--target", str(target))
    assert rc == 1 and "✖ lfs-pointers" in out


def test_truncated_safetensors(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    p = draft / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    report = run_checks(draft, target)
    assert checks_of(report) == {"safetensors"}
    assert "truncated" in messages(report, "safetensors")


def test_missing_tensor(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_tensors(draft, lambda s: s.pop("layers.1.mlp.up_proj.weight"))
    report = run_checks(draft, target)
    assert checks_of(report) == {"roster"}
    assert "missing tensor 'layers.1.mlp.up_proj.weight'" in messages(report, "roster")


def test_wrong_shape_tensor(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_tensors(draft, lambda s: s.update({"context_norm.weight": torch.ones(31)}))
    report = run_checks(draft, target)
    assert checks_of(report) == {"roster"}
    msg = messages(report, "roster")
    assert "context_norm.weight" in msg and "[32]" in msg and "[31]" in msg


# ---------------------------------------------------------------------------------------- vocab / heads


def test_vocab_mismatch_with_target(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_config(target, vocab_size=128)
    report = run_checks(draft, target)
    assert "vocab" in checks_of(report)
    msg = messages(report, "vocab")
    assert "draft vocab_size 96 != target vocab_size 128" in msg
    assert "96 rows but the target vocab_size is 128" in msg  # the target's own embedding disagrees too


def test_vocab_mismatch_with_draft_rows(pair: tuple[Path, Path]) -> None:
    _, draft = pair
    edit_tensors(draft, lambda s: s.update({"embed_tokens.weight": torch.zeros(100, 32)}))
    report = run_checks(draft)
    assert "vocab" in checks_of(report)
    assert "embed_tokens.weight has 100 rows but the draft vocab_size is 96" in messages(report, "vocab")


def test_missing_lm_head_with_a_different_target(pair: tuple[Path, Path], tmp_path: Path) -> None:
    _, draft = pair
    other, _ = write_tiny_pair(tmp_path / "other", target_cfg=tiny_target_config(hidden_size=48))
    report = run_checks(draft, other)
    assert {"lm-head", "embedding", "hidden-size"} <= checks_of(report)
    msg = messages(report, "lm-head")
    assert "no usable lm_head" in msg and "[96, 48]" in msg and "[96, 32]" in msg
    assert "lm_head.safetensors" in next(p.fix for p in report.problems if p.check == "lm-head")
    # the draft's own lm_head.safetensors makes the lm_head available again
    save_file({"lm_head.weight": torch.zeros(VOCAB, 32)}, draft / "lm_head.safetensors")
    assert "lm-head" in run_checks(draft, other).passed


def test_confidence_head_enabled_but_missing(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_tensors(draft, lambda s: [s.pop(k) for k in list(s) if k.startswith("confidence_head.")])
    report = run_checks(draft, target)
    assert checks_of(report) == {"confidence-head"}
    assert "enable_confidence_head: true" in messages(report, "confidence-head")


def test_confidence_head_present_but_disabled(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_config(draft, enable_confidence_head=False)
    report = run_checks(draft, target)
    assert checks_of(report) == {"confidence-head"}
    assert "enable_confidence_head: false" in messages(report, "confidence-head")


def test_markov_tensors_iff_markov_rank(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_tensors(draft, lambda s: s.pop("markov_head.markov_w2.weight"))
    report = run_checks(draft, target)
    assert checks_of(report) == {"markov-head"}
    assert "markov_w2" in messages(report, "markov-head")

    edit_config(draft, markov_rank=0)
    report = run_checks(draft, target)
    assert "markov-head" in checks_of(report)
    assert "set markov_rank to 8" in next(p.fix for p in report.problems if p.check == "markov-head")


# ---------------------------------------------------------------------------------------- special tokens


def test_mask_id_outside_vocab(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_config(draft, mask_token_id=VOCAB)
    report = run_checks(draft, target)
    assert checks_of(report) == {"special-tokens"}  # not a config parse error hiding the other checks
    assert "mask_token_id 96 is outside the vocabulary [0, 96)" in messages(report, "special-tokens")
    assert not run_checks(draft).ok  # a draft-only check


def test_mask_id_mismatch_with_tokenizer(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_config(draft, mask_token_id=7)
    report = run_checks(draft, target)
    assert checks_of(report) == {"special-tokens"}
    msg = messages(report, "special-tokens")
    assert "'<mask>' is id 3" in msg and "mask_token_id is 7" in msg


def test_eos_mismatch_with_tokenizer(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    write_tokenizer(target, eos_token="<pad>")
    report = run_checks(draft, target)
    assert checks_of(report) == {"special-tokens"}
    msg = messages(report, "special-tokens")
    assert "eos_token '<pad>' is id 2" in msg and "draft" in msg and "target" in msg


def test_eos_mismatch_between_draft_and_target(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_config(draft, eos_token_id=5)
    report = run_checks(draft, target)
    assert checks_of(report) == {"special-tokens"}
    assert "eos_token_id differs: draft [5] vs target [1]" in messages(report, "special-tokens")


def test_tokenizer_must_be_in_the_target_dir(pair: tuple[Path, Path]) -> None:
    """The engine reads the target's tokenizer: one only in the draft dir does not count (it did before)."""
    target, draft = pair
    edit_config(target, dspark_random_weights=None)  # a real model (write_tiny_pair marks its weights random)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.move(target / name, draft / name)
    assert "tokenizer" in run_checks(draft).passed  # without --target the draft's is checked
    report = run_checks(draft, target)
    assert checks_of(report) == {"tokenizer"}
    assert f"no tokenizer.json in the target directory {target}" in messages(report, "tokenizer")
    edit_config(target, dspark_random_weights=True)  # explicitly random test weights may run on bytes
    report = run_checks(draft, target)
    assert report.ok and "explicitly random" in report.skip_reasons["tokenizer"]


def test_target_missing_a_tensor(pair: tuple[Path, Path]) -> None:
    """Used to report "all 16 checks passed"."""
    target, draft = pair
    edit_tensors(target, lambda s: s.pop("model.layers.1.self_attn.kv_b_proj.weight"))
    report = run_checks(draft, target)
    assert checks_of(report) == {"target-roster"}
    assert "missing tensor 'model.layers.1.self_attn.kv_b_proj.weight'" in messages(report, "target-roster")


def relabel(file: Path, name: str, dtype: str) -> None:
    """Rewrite one tensor's dtype in a safetensors header in place (same byte size: nothing else notices)."""
    data = file.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header[name]["dtype"] = dtype
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    file.write_bytes(data[:8] + raw + data[8 + n :])


def to_bf16(d: Path) -> None:
    edit_tensors(d, lambda s: s.update({k: v.to(torch.bfloat16) for k, v in s.items()}))
    edit_config(d, torch_dtype="bfloat16")


def test_dtype_relabelled_in_the_header(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    to_bf16(draft)
    to_bf16(target)
    assert run_checks(draft, target).ok
    relabel(draft / "model.safetensors", "layers.0.mlp.down_proj.weight", "F16")
    relabel(target / "model.safetensors", "model.norm.weight", "F16")
    report = run_checks(draft, target)
    assert checks_of(report) == {"dtype"}
    msg = messages(report, "dtype")
    assert "'layers.0.mlp.down_proj.weight'" in msg and "'model.norm.weight'" in msg and "stored as F16" in msg


# ---------------------------------------------------------------------------------------- rope / taps


def test_yarn_factor_mismatch(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    rope = json.loads((draft / "config.json").read_text())["rope_parameters"]
    edit_config(draft, rope_parameters=rope | {"factor": 8.0})
    report = run_checks(draft, target)
    assert checks_of(report) == {"yarn"}
    assert "YaRN factor differs: draft 8.0 vs target 4.0" in messages(report, "yarn")
    assert "yarn" in run_checks(draft).skipped


def test_yarn_missing_in_draft(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_config(draft, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    report = run_checks(draft, target)
    assert checks_of(report) == {"yarn"}
    assert "does not" in messages(report, "yarn")


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ([2, 0], "not strictly increasing"),
        ([1, 1], "not strictly increasing"),
        ([0, 7], "outside the target's 4 layers"),
        ([0, 3], "last layer 3"),
    ],
)
def test_bad_target_layer_ids(pair: tuple[Path, Path], ids: list[int], expected: str) -> None:
    target, draft = pair
    edit_config(draft, target_layer_ids=ids)
    for report in (run_checks(draft, target), run_checks(draft)):
        assert checks_of(report) == {"target-layer-ids"}
        assert expected in messages(report, "target-layer-ids")
    if expected.startswith("last"):
        fix = next(p.fix for p in report.problems if p.check == "target-layer-ids")
        assert "hidden_states[-1]" in fix and "post-norm" in fix


def test_target_depth_disagrees_with_draft(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_config(target, num_hidden_layers=3)  # the draft's tap 2 is then the target's last layer
    report = run_checks(draft, target)
    msg = messages(report, "target-layer-ids")
    assert "target_num_hidden_layers = 4 but the target has num_hidden_layers = 3" in msg
    assert "last layer 2" in msg


# ---------------------------------------------------------------------------------------- bf16


def test_weight_that_overflows_bf16(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    big = 3.4e38  # finite in fp32 (max 3.40e38), but rounds to inf in bf16 (max 3.39e38)
    assert torch.isfinite(torch.tensor(big)) and torch.isinf(torch.tensor(big).bfloat16())

    def poke(s: dict[str, torch.Tensor]) -> None:
        s["layers.0.mlp.down_proj.weight"][3, 5] = big

    edit_tensors(draft, poke)
    report = run_checks(draft, target)
    assert checks_of(report) == {"bf16"}
    msg = messages(report, "bf16")
    assert "layers.0.mlp.down_proj.weight" in msg and "1 values that overflow to inf in bf16" in msg


def test_nan_and_inf_weights(pair: tuple[Path, Path]) -> None:
    target, draft = pair

    def poke(s: dict[str, torch.Tensor]) -> None:
        s["final_norm.weight"][0] = float("nan")
        s["context_proj.weight"][1, 1] = float("inf")  # e.g. 1e39 written as fp32

    edit_tensors(draft, poke)
    report = run_checks(draft, target)
    assert checks_of(report) == {"bf16"}
    msg = messages(report, "bf16")
    assert "'final_norm.weight' has 1 NaN and 0 Inf" in msg and "'context_proj.weight' has 0 NaN and 1 Inf" in msg


def test_bf16_scan_reads_in_chunks(pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import dspark.doctor.weights as doctor

    target, draft = pair

    def poke(s: dict[str, torch.Tensor]) -> None:
        s["markov_head.markov_w1.weight"][90, 0] = float("nan")  # in the last chunk

    edit_tensors(draft, poke)
    monkeypatch.setattr(doctor, "_CHUNK_ELEMENTS", 16)
    report = run_checks(draft, target)
    assert "'markov_head.markov_w1.weight' has 1 NaN" in messages(report, "bf16")


# ---------------------------------------------------------------------------------------- robustness / output


def test_broken_inputs_never_raise(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    target, draft = pair
    report = run_checks(tmp_path / "nope")
    assert checks_of(report) == {"draft-config"} and "does not exist" in report.problems[0].message
    (draft / "config.json").write_text("{not json")
    report = run_checks(draft, tmp_path / "missing-target")
    assert {"draft-config", "target-config"} <= checks_of(report)
    edit_config(target, hidden_size=None)
    (draft / "config.json").write_text("{}")
    report = run_checks(draft, target)
    assert not report.ok
    assert all(p.message and p.fix for p in report.problems)


def test_json_output_schema(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = pair
    rc, out = cli(capsys, str(draft), "--target", str(target), "--json")
    clean = json.loads(out)
    assert rc == 0 and clean["ok"] is True and clean["problems"] == []
    assert [s["step"] for s in clean["steps"]] == [1, 2, 3, 4, 5, 6]

    edit_config(draft, mask_token_id=VOCAB, target_layer_ids=[0, 3])
    rc, out = cli(capsys, str(draft), "--target", str(target), "--json")
    data = json.loads(out)
    assert rc == 1
    assert {"ok", "problems"} <= set(data) and data["ok"] is False
    assert {p["check"] for p in data["problems"]} == {"special-tokens", "target-layer-ids"}
    for p in data["problems"]:
        assert set(p) == {"check", "message", "fix"}
        assert all(isinstance(p[k], str) and p[k] for k in p)
    precision = data.pop("precision")  # the CLI adds what the target would be served in on this machine
    assert precision["quantization"] == "none" and precision["cpu_capability"]
    assert data == report_json(run_checks(draft, target))


def test_human_output_one_line_per_problem_with_fix(
    pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    target, draft = pair
    edit_config(draft, mask_token_id=VOCAB, target_layer_ids=[0, 3])
    report = run_checks(draft, target)
    rc, out = cli(capsys, str(draft), "--target", str(target))
    assert rc == 1
    bad = [line for line in out.splitlines() if line.lstrip().startswith("✖ ") and "fix:" in line]
    assert len(bad) == len(report.problems) >= 2
    assert out.rstrip().endswith(f"{len(report.problems)} problems in 2 of {len(CHECKS)} checks")
    assert "X " in format_report(report, ascii_only=True) and "✖" not in format_report(report, ascii_only=True)


def test_output_follows_the_six_deployment_steps(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = pair
    rc, out = cli(capsys, str(draft), "--target", str(target))
    assert rc == 0
    heads = [i for i, line in enumerate(out.splitlines()) if line.startswith("[")]
    assert [out.splitlines()[i][:5] for i in heads] == [f"[{n}/6]" for n in range(1, 7)]
    order = [out.index(f" {name}: ") for name in ("lfs-pointers", "lm-head", "target-layer-ids", "yarn", "markov-head")]
    assert order == sorted(order)  # weights, layer mapping, KV cache + YaRN, heads
    assert f"dspark verify-lossless --model {target}" in out and f'"model": "{draft}"' in out  # step 5
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total"):
        assert name in out  # step 6
    assert "B per token" in out and "enable_adaptive_verification" in out  # step 3 and 4 notes


def test_package_direction_checkpoint_models_doctor() -> None:
    """dspark.checkpoint (file formats) <- dspark.models <- dspark.doctor: the doctor used to live in
    checkpoint/ and import models, which imports checkpoint (a package cycle)."""
    from test_package_health import import_graph

    graph = import_graph()

    def imports(pkg: str, other: str) -> list[str]:
        return sorted(m for m, deps in graph.items() if m.startswith(pkg) and any(d.startswith(other) for d in deps))

    assert imports("dspark.checkpoint", "dspark.models") == []
    assert imports("dspark.checkpoint", "dspark.doctor") == []
    assert imports("dspark.models", "dspark.doctor") == []


def test_a_bad_draft_vocab_file_is_reported(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    (draft / "draft_vocab.json").write_text(json.dumps({"token_ids": [3, 3, 5], "default_size": 3}))
    report = run_checks(draft, target)
    assert "token_ids must be distinct ids in [0, 96)" in messages(report, "vocab")
    (draft / "draft_vocab.json").write_text(json.dumps({"token_ids": [3, 4, 5], "default_size": 2}))
    assert "vocab" not in checks_of(run_checks(draft, target))


# ---------------------------------------------------------------------------------------- root causes


def check_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`dspark check ...` as a user runs it: a subprocess of this interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "dspark.cli", "check", *args], capture_output=True, text=True, timeout=300
    )


def test_misspelled_draft_key_exits_1_and_names_the_key(pair: tuple[Path, Path]) -> None:
    """`kv_lora_rnk` used to pass whenever the default (512) happened to fit: the value was silently dropped."""
    target, draft = pair
    cfg = json.loads((draft / "config.json").read_text())
    edit_config(draft, kv_lora_rank=None, kv_lora_rnk=cfg["kv_lora_rank"])
    done = check_cli(str(draft), "--target", str(target))
    assert done.returncode == 1, done.stdout
    assert "unknown key 'kv_lora_rnk' (did you mean 'kv_lora_rank'?)" in done.stdout
    assert "rename 'kv_lora_rnk' to 'kv_lora_rank'" in done.stdout
    # the weights hold the real rank: roster names the key, its default and what the weights hold, once
    assert "`kv_lora_rank` 512 (not set in config.json: its default) does not match the weights (16)" in done.stdout


def test_misspelling_a_key_whose_default_fits_is_still_a_problem(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_config(draft, markov_head_type=None, markov_head_typ="vanilla")  # the default: every shape agrees
    report = run_checks(draft, target)
    assert checks_of(report) == {"draft-config"}
    assert "'markov_head_typ' (did you mean 'markov_head_type'?)" in messages(report, "draft-config")
    assert "takes its default ('vanilla')" in messages(report, "draft-config")


def test_misspelled_target_key_is_a_problem(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_config(target, routed_scaling_factor=None, routed_scaling_factr=1.5)
    report = run_checks(draft, target)
    assert checks_of(report) == {"target-config"}
    assert "'routed_scaling_factr' (did you mean 'routed_scaling_factor'?)" in messages(report, "target-config")


def test_an_unknown_key_close_to_nothing_is_a_note(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_config(draft, trained_on="my corpus")
    edit_config(target, _comment="metadata keys starting with _ pass", serving_notes="x")
    report = run_checks(draft, target)
    assert report.ok
    notes = "\n".join(report.notes[1])
    assert f"{draft / 'config.json'}: keys dspark does not read (ignored): trained_on" in notes
    assert f"{target / 'config.json'}: keys dspark does not read (ignored): serving_notes" in notes
    assert "_comment" not in notes


def official_configs(tmp_path: Path) -> dict[str, dict[str, object]]:
    """Every config.json dspark ships or writes: bundled models, the official formats, the tiny test pairs."""
    from dspark.checkpoint.resolve import BUNDLED_DIR
    from dspark.models.tiny import tiny_draft_config, write_tiny_gqa_pair, write_tiny_hybrid_pair

    files = sorted(BUNDLED_DIR.glob("*/config.json")) + sorted(BUNDLED_DIR.glob("formats/*.json"))
    files += [*write_tiny_gqa_pair(tmp_path / "gqa"), *write_tiny_hybrid_pair(tmp_path / "hybrid")]
    configs = {str(f): json.loads((f / "config.json" if f.is_dir() else f).read_text()) for f in files}
    configs["tiny_target_config"] = tiny_target_config().to_hf_dict()
    configs["tiny_draft_config"] = tiny_draft_config(tiny_target_config()).to_dict()
    return configs


def test_no_official_or_bundled_config_key_is_flagged(tmp_path: Path) -> None:
    from dspark.models.families import family_of

    configs = official_configs(tmp_path)
    assert len(configs) >= 16
    for where, raw in configs.items():
        family = family_of(raw)
        assert family is not None, where
        assert family.config.KEYS.unknown(raw) == {}, where


def test_a_single_hidden_size_change_is_one_root_cause_line(pair: tuple[Path, Path]) -> None:
    """Used to print 22 "wrong shape" lines, none naming hidden_size."""
    target, draft = pair
    edit_config(draft, hidden_size=40)
    report = run_checks(draft, target)
    assert len(report.problems) == 1 and report.problems[0].check == "roster"
    message = report.problems[0].message
    assert message.startswith(f"{draft / 'config.json'}: `hidden_size` 40 does not match the weights (32)\n")
    assert "20 tensors of" in message and "first: 'context_norm.weight' expected [40], found [32]" in message
    assert '"hidden_size": 32' in report.problems[0].fix
    assert "see roster" in report.skip_reasons["lm-head"] and "see roster" in report.skip_reasons["embedding"]
    done = check_cli(str(draft), "--target", str(target), "--json")
    assert done.returncode == 1
    problems = json.loads(done.stdout)["problems"]
    assert [p["message"].splitlines()[0] for p in problems] == [message.splitlines()[0]]
    human = check_cli(str(draft), "--target", str(target))
    assert human.returncode == 1 and human.stdout.count("✖") == 2  # the problem and the summary line


def test_a_hidden_size_change_without_target_hidden_size_is_still_one_problem(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_config(draft, hidden_size=40, target_hidden_size=None)  # target_hidden_size defaults to hidden_size
    report = run_checks(draft, target)
    assert [p.check for p in report.problems] == ["roster"]
    assert "`hidden_size` 40 does not match the weights (32)" in report.problems[0].message
    assert "see roster" in report.skip_reasons["hidden-size"]


def test_a_target_key_the_weights_contradict_is_named(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_config(target, intermediate_size=72)
    report = run_checks(draft, target)
    assert checks_of(report) == {"target-roster"}
    assert len(report.problems) == 1
    assert "`intermediate_size` 72 does not match the weights (64)" in messages(report, "target-roster")


def test_no_single_key_explains_it_keeps_a_line_per_tensor(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    edit_tensors(draft, lambda s: s.update({"context_norm.weight": torch.ones(31), "final_norm.weight": torch.ones(9)}))
    report = run_checks(draft, target)
    assert len(report.problems) == 2 and "does not match the weights" not in messages(report, "roster")
