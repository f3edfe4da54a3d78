"""The speed tooling: profiler scopes, the `dspark profile --breakdown` table, measured thread defaults."""

import json

import torch
from torch.profiler import ProfilerActivity, profile

from dspark import profiling, threads
from dspark.bench.breakdown import exclusive_scope_times
from dspark.cli import main
from dspark.config import EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.engine.metrics import DecodeTimes, tau_bound
from dspark.models.tiny import build_tiny_pair, write_tiny_pair
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
    ):
        assert f"| {row}" in out or f"| **{row}" in out, row


def test_thread_choice_is_measured_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
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
        cached = json.loads((tmp_path / "dspark" / "threads.json").read_text())
        assert [v["threads"] for v in cached.values()] == [1]
        calls.clear()
        assert threads.choose_threads("model-a", workload) == 1 and calls == []  # cached: no new calibration
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
