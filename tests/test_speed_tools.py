"""The speed tooling: profiler scopes, the `dspark profile --breakdown` table, measured thread defaults."""

import dataclasses
import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import dspark.native as native
from dspark import profiling, threads
from dspark.bench.breakdown import exclusive_scope_times, kernel_times
from dspark.cli import main
from dspark.config import EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.engine.metrics import DecodeTimes, tau_bound
from dspark.models.llama import LlamaTarget
from dspark.models.target import MoE, grouped_experts
from dspark.models.tiny import build_tiny_pair, randomize_, tiny_gqa_config, write_tiny_pair
from dspark.sampling_params import SamplingParams


def test_scopes_are_a_shared_no_op_unless_recording():
    assert profiling.scope("target.forward") is profiling.scope("attn.core")
    with profiling.recording():
        assert isinstance(profiling.scope("attn.core"), torch.profiler.record_function)
    assert profiling.scope("attn.core") is profiling.scope("cache")


def test_exclusive_times_nest_generic_scopes_under_their_phase():
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof, profiling.recording():
        with profiling.scope("draft.backbone"):
            with profiling.scope("attn.core"):
                for _ in range(20):
                    x = x @ x.T / 64
        with profiling.scope("target.forward"):
            with profiling.scope("attn.core"):
                x = x @ x.T / 64
            x = x + 1
    times = exclusive_scope_times(prof.events())
    assert set(times) == {"draft.backbone", "draft.backbone/attn.core", "target.forward", "target.forward/attn.core"}
    assert times["draft.backbone/attn.core"] > times["target.forward/attn.core"] > 0
    inclusive = {e.key: e.cpu_time_total for e in prof.key_averages()}
    # exclusive parts add up to the phase's inclusive time: nothing counted twice, nothing lost
    for phase in ("draft.backbone", "target.forward"):
        parts = times[phase] + times[phase + "/attn.core"]
        assert abs(parts - inclusive["dspark::" + phase]) < 1e-6 * inclusive["dspark::" + phase]


def test_kernel_times_split_products_and_attention_from_the_rest():
    x, w = torch.randn(1, 64), torch.randn(256, 64)
    q = torch.randn(1, 2, 1, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            torch.nn.functional.linear(x, w)
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
            x = x + 1
    times = kernel_times(prof.events())
    assert times["gemm"] > 0 and times["attention"] > 0
    total = sum(e.self_cpu_time_total for e in prof.events())
    assert times["gemm"] + times["attention"] < total  # the adds and the callers' dispatch are neither


def test_breakdown_cli_reports_every_phase(tmp_path, capsys):
    target_dir, draft_dir = write_tiny_pair(tmp_path / "pair", 0)
    argv = ["profile", "--breakdown", "--model", str(target_dir), "--draft", str(draft_dir), "--steps", "2"]
    assert main([*argv, "--warmup", "0", "--dtype", "float32", "--num-threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "intra-op 1 (--num-threads)" in out
    for row in (
        "step.metadata",
        "target.forward/attn.core",
        "target.forward/moe.experts",
        "draft.markov",
        "draft.backbone/attn.core",
        "step.accept",
        "wall step, unprofiled",
        "CPU ms per token",
        "matrix-product kernels (all scopes)",
        "everything else",
    ):
        assert f"| {row}" in out or f"| **{row}" in out, row


def test_thread_choice_is_measured_then_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "dspark"))
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    calls = []

    def workload():  # slower with more threads, as tiny decode steps on a busy 2-core machine
        calls.append(torch.get_num_threads())
        x = torch.zeros(1)
        for _ in range(200 * torch.get_num_threads()):
            x = x + 1

    before = torch.get_num_threads()
    try:
        assert threads.choose_threads("model-a", workload) == 1 and torch.get_num_threads() == 1
        assert set(calls) == {1, 2, 4}
        said = capsys.readouterr().err  # one line saying what it does and how to skip it
        assert said.count("\n") == 1 and "--threads N" in said and threads.ENV in said
        cached = json.loads((tmp_path / "dspark" / "threads.json").read_text())
        assert [v["threads"] for v in cached.values()] == [1]
        calls.clear()
        assert threads.choose_threads("model-a", workload) == 1 and calls == []  # cached: no new calibration
        assert capsys.readouterr().err == ""
        monkeypatch.setenv(threads.ENV, "3")
        assert threads.choose_threads("model-a", workload) == 3 and calls == []
        assert "intra-op 3 ($DSPARK_NUM_THREADS)" in threads.describe_threads()
    finally:
        torch.set_num_threads(before)


def test_tau_bound_is_tau_times_step_cost_ratio():
    ar = DecodeTimes(steps=10, propose_s=0.0, verify_s=0.09, total_s=0.1)  # 10 ms per plain step
    spec = DecodeTimes(steps=4, propose_s=0.008, verify_s=0.040, total_s=0.06)  # 2 + 10 ms per round
    assert abs(tau_bound(5.0, ar, spec) - 5.0 * 10 / 12) < 1e-12
    assert tau_bound(5.0, DecodeTimes(), spec) is None


def test_engine_times_every_decode_step():
    target, drafter = build_tiny_pair(0)
    eng = Engine(target, drafter, SpeculativeConfig(num_speculative_tokens=3), EngineConfig(dtype="float32"))
    eng.add_request([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while eng.has_unfinished:
        eng.step()
    d = eng.metrics.decode
    assert d.steps == eng.metrics.spec.num_steps > 0
    assert 0 < d.propose_s and 0 < d.verify_s and d.propose_s + d.verify_s <= d.total_s


# ---- the fast inference paths are the reference paths, bit for bit in fp32 ----


def _logits(model, ids):
    with torch.inference_mode():
        return model(ids).logits


@pytest.mark.parametrize("family", ["mla", "llama", "llama-bias"])
def test_fused_weights_give_bit_identical_fp32_logits(monkeypatch, family):
    monkeypatch.setenv(native.ENV, "0")  # the modules' path, fp32's reference (the native kernels sum otherwise)
    if family == "mla":
        target, _ = build_tiny_pair(3)
    else:
        cfg = tiny_gqa_config("llama")
        if family == "llama-bias":
            cfg = dataclasses.replace(cfg, mlp_bias=True)
        target = LlamaTarget(cfg)
        randomize_(target, 3)
    target = target.float()
    ids = torch.randint(4, target.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    ref = _logits(target, ids)
    target.fuse_for_inference()
    assert torch.equal(_logits(target, ids), ref)
    target.fuse_for_inference()  # idempotent
    assert torch.equal(_logits(target, ids), ref)
    with torch.no_grad():  # the fused tensors track in-place weight updates (load_state_dict copies into views)
        mlp = target.model.layers[0].mlp
        mlp.up_proj.weight.mul_(1.5)
        assert mlp.fused_gate_up() is not None
        fused = _logits(target, ids)
        mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight.clone())  # re-assigned: falls back, same values
        assert mlp.fused_gate_up() is None and torch.equal(_logits(target, ids), fused)


def test_grouped_moe_equals_the_per_expert_loop(monkeypatch):
    monkeypatch.setenv(native.ENV, "0")  # the experts' modules on both sides
    target, _ = build_tiny_pair(5)
    target = target.float()
    moe = next(layer.mlp for layer in target.model.layers if isinstance(layer.mlp, MoE))
    x = torch.randn(37, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        idx, w = moe.gate(x)
        ref = moe._routed_loop(x, idx, w)
        target.fuse_for_inference()
        out = grouped_experts(x, idx, w, moe.stacked_experts())
    assert torch.equal(out, ref)
    assert len(idx.unique()) > 1
    with torch.enable_grad():
        assert moe.stacked_experts() is None  # training keeps the reference path


def test_absorbed_mla_weight_cache_follows_the_weights():
    target, _ = build_tiny_pair(2)
    target = target.float()
    attn = target.model.layers[0].self_attn
    ids = torch.randint(4, target.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    before = _logits(target, ids)
    with torch.no_grad():
        attn.kv_b_proj.weight.mul_(0.5)  # in place: the cached W_UV^T must be rebuilt
    after = _logits(target, ids)
    with torch.no_grad():
        attn.kv_b_proj.weight.mul_(2.0)
    assert not torch.equal(before, after) and torch.equal(_logits(target, ids), before)


def test_more_threads_must_win_by_the_margin():
    assert threads.pick({1: 0.100, 2: 0.095}) == 1  # 5 % faster: not worth a barrier partner
    assert threads.pick({1: 0.100, 2: 0.080, 4: 0.075}) == 2
    assert threads.pick({1: 0.100, 2: 0.080, 4: 0.060}) == 4


def test_profile_runs_with_the_thread_count_generate_calibrated(tmp_path, monkeypatch, capsys):
    """profile builds no engine, yet it reports and uses the count the engines calibrated for this machine and
    model (every command reports the same thread count)."""
    import json

    import torch

    from dspark import threads
    from dspark.cli import main
    from dspark.models.loading import load_target
    from dspark.models.tiny import write_tiny_pair

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DSPARK_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_explicit", False)
    target_dir, _ = write_tiny_pair(tmp_path / "pair", 0)
    params = sum(p.numel() for p in load_target(target_dir, "float32").parameters())
    key = threads._key(threads.usable_cores(), threads.model_key(target_dir.name, "float32", params))
    threads.write_cache(threads._cache_path(), {key: {"threads": 1}})
    before = torch.get_num_threads()
    try:
        argv = ["profile", "--model", str(target_dir), "--no-draft", "--batch-sizes", "1", "--max-tokens-per-request"]
        argv += ["1", "--context-len", "8", "--repeats", "1", "--dtype", "float32"]
        argv += ["--output", str(tmp_path / "s.json")]
        assert main(argv) == 0
        assert ", 1 threads" in capsys.readouterr().err
        assert json.loads((tmp_path / "s.json").read_text())["meta"]["num_threads"] == 1
    finally:
        torch.set_num_threads(before)
