"""Engine options vLLM users pass: --dtype (one accepted set everywhere, "auto" on the engine commands; see
test_precision.py) and swap_space (rejected, not ignored)."""

import json

import pytest
import torch

from dspark.cli import build_parser, main
from dspark.config import DTYPE_CHOICES, DTYPES, CacheConfig, ConfigError, EngineConfig
from dspark.llm import LLM, build_engines, engine_configs
from dspark.models.tiny import write_tiny_pair
from dspark.sampling_params import SamplingParams

SUBCOMMANDS = {
    "generate": [],
    "verify-lossless": ["--dataset", "d"],
    "serve": [],
    "bench": [],
    "calibrate": ["--dataset", "d"],
    "profile": [],
    "draft-data": [],
}


def test_dtype_error_lists_exactly_the_accepted_values():
    assert DTYPES == ("bfloat16", "float16", "float32") and DTYPE_CHOICES == ("auto", *DTYPES)
    for name in DTYPE_CHOICES:
        assert EngineConfig(dtype=name).dtype == name
    with pytest.raises(ConfigError, match="dtype") as err:
        EngineConfig(dtype="float64")
    assert str(list(DTYPE_CHOICES)) in str(err.value)


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_command_accepts_every_engine_dtype(command):
    parser = build_parser()
    for name in DTYPES:
        assert parser.parse_args([command, *SUBCOMMANDS[command], "--dtype", name]).dtype == name
    with pytest.raises(SystemExit):
        parser.parse_args([command, *SUBCOMMANDS[command], "--dtype", "float64"])


def test_float16_runs_end_to_end(tmp_path, capsys):
    target_dir, draft_dir = write_tiny_pair(tmp_path)
    spec = {"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 4}
    spec_eng, ar_eng = build_engines(target_dir, [spec, None], *engine_configs(dtype="float16"))
    assert next(spec_eng.target.parameters()).dtype == spec_eng.pool.dtype == torch.float16
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[0, 5, 6, 7], [0, 9, 10, 11, 12]]
    ref = [o.token_ids for o in LLM.from_engine(ar_eng).generate(prompts, params)]
    assert [o.token_ids for o in LLM.from_engine(spec_eng).generate(prompts, params)] == ref
    argv = ["generate", "abc", "--model", str(target_dir), "--dtype", "float16", "--max-tokens", "6", "--json"]
    argv += ["--speculative-config", json.dumps(spec)]
    assert main(argv) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 6


def test_swap_space_is_rejected_with_a_message_not_ignored(tmp_path):
    assert CacheConfig(swap_space=0).swap_space == 0 and CacheConfig().swap_space is None
    with pytest.raises(ConfigError, match="swap_space.*not supported.*recomputes preempted requests; pass 0"):
        CacheConfig(swap_space=4)
    target_dir, _ = write_tiny_pair(tmp_path)
    with pytest.raises(ConfigError, match="swap_space"):
        LLM(str(target_dir), swap_space=4, dtype="float32")
    assert LLM(str(target_dir), swap_space=0, dtype="float32").engine is not None
