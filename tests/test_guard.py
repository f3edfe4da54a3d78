"""The speculation guard (drafting only while it pays) and vLLM's disable_by_batch_size: the switch follows the
measured rates, and switching never changes a greedy token."""

import json
import time

import pytest
import torch

from dspark.cli import guard_lines, main
from dspark.config import ConfigError, EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.llm import LLM
from dspark.models.tiny import build_tiny_pair
from dspark.sampling_params import SamplingParams
from dspark.speculative.guard import SpeculationGuard


def _drive(guard: SpeculationGuard, steps: int, draft_rate: float, plain_rate: float, batch: int = 1) -> list[bool]:
    """Run ``steps`` decode steps whose modes emit at the given tokens/s (one second per step); return the modes."""
    modes = []
    for _ in range(steps):
        drafting = guard.drafting(batch)
        modes.append(drafting)
        guard.observe(batch, drafting, round(draft_rate if drafting else plain_rate), 1.0)
    return modes


def test_guard_turns_drafting_off_when_plain_steps_are_faster_and_keeps_probing_less_often():
    guard = SpeculationGuard(period=10, probe=2, warmup=3, max_period=40, cold=0)
    modes = _drive(guard, 150, draft_rate=2, plain_rate=3)
    assert modes[:3] == [True] * 3  # warm-up rounds, then the first probe of plain decoding
    assert modes[3:5] == [False, False]
    after = "".join("d" if m else "p" for m in modes[5:])
    probes = [r for r in after.split("p") if r]
    assert len(probes) >= 4 and set(probes[:-1]) == {"dd"}  # probes of speculation keep coming, two rounds each
    gaps = [len(r) for r in after.split("dd")][:4]
    assert gaps == [10, 20, 40, 40]  # each confirming probe doubles the wait, up to max_period
    assert guard.report()["1"]["drafting"] is False
    assert "up to every 40" in guard.describe()[0]


def test_a_probe_that_drafting_wins_brings_the_period_back():
    guard = SpeculationGuard(period=4, probe=1, warmup=1, max_period=64, alpha=1.0, cold=0)
    _drive(guard, 60, draft_rate=1, plain_rate=3)  # plain leads; the wait has grown
    assert guard.buckets[1].period > 4
    modes = _drive(guard, 200, draft_rate=5, plain_rate=3)  # the text turned predictable
    assert modes[-1] is True and guard.buckets[1].period == 4
    tail = "".join("d" if m else "p" for m in modes[-40:])
    assert tail.count("p") >= 40 // 5 - 1  # plain decoding is probed every 4 rounds again


def test_drafting_keeps_the_lead_on_a_near_tie_and_hands_it_back_beyond_the_margin():
    """Hysteresis both ways: rounds a few per cent slower than plain steps (a few unlucky rounds) keep drafting on;
    rounds slower by more than the margin hand the lead to plain steps."""
    guard = SpeculationGuard(period=4, probe=1, warmup=1, max_period=8, alpha=1.0, margin=0.1, cold=0)
    near_tie = _drive(guard, 60, draft_rate=19, plain_rate=20)  # 5 % slower: within the margin
    assert near_tie[-10:].count(True) >= 8 and guard.drafting(1) is True
    losing = _drive(guard, 60, draft_rate=15, plain_rate=20)  # 25 % slower: plain steps lead
    assert losing[-10:].count(True) <= 3 and guard.drafting(1) is False


def test_drafting_takes_the_lead_back_only_by_the_margin():
    guard = SpeculationGuard(period=4, probe=1, warmup=1, max_period=8, alpha=1.0, margin=0.1, cold=0)
    _drive(guard, 20, draft_rate=10, plain_rate=20)  # plain leads
    near_tie = _drive(guard, 60, draft_rate=21, plain_rate=20)  # rounds 5 % faster: not worth leaving plain for
    assert near_tie.count(True) <= 60 // 4 and guard.drafting(1) is False
    clear = _drive(guard, 60, draft_rate=25, plain_rate=20)  # 25 % faster: drafting leads again
    assert clear[-10:].count(True) >= 8
    with pytest.raises(ValueError, match="margin"):
        SpeculationGuard(margin=-0.1)


def test_drafting_that_stops_paying_hands_the_lead_back_at_once():
    guard = SpeculationGuard(period=16, probe=1, warmup=1, max_period=16, alpha=0.5, cold=0)
    _drive(guard, 40, draft_rate=1, plain_rate=3)  # plain leads, drafting probed every 16 steps
    lucky = iter([12])  # the next probe round accepts a whole block: drafting wins the probe
    modes = []
    for _ in range(60):
        drafting = guard.drafting(1)
        modes.append("d" if drafting else "p")
        guard.observe(1, drafting, next(lucky, 1) if drafting else 3, 1.0)
    runs = [len(r) for r in "".join(modes).split("p") if r]
    assert max(runs) == 3  # the lucky probe and two rounds until the average falls below plain; not 16 rounds
    assert guard.buckets[1].off_at is not None and guard.drafting(1) is False


def test_guard_keeps_drafting_when_rounds_pay_and_decides_per_batch_size():
    guard = SpeculationGuard(period=10, probe=2, warmup=3, cold=0)
    fast = _drive(guard, 60, draft_rate=5, plain_rate=1, batch=1)
    slow = _drive(guard, 60, draft_rate=1, plain_rate=5, batch=16)
    assert fast.count(False) <= 2 * (60 // 10 + 1) and fast[-1] is True
    assert slow.count(True) < 20
    rep = guard.report()
    assert rep["1"]["drafting"] is True and rep["16-31"]["drafting"] is False
    assert rep["1"]["draft_tok_s"] == 5.0 and rep["16-31"]["plain_tok_s"] == 5.0


def test_guard_follows_a_change_of_regime():
    guard = SpeculationGuard(period=8, probe=2, warmup=2, alpha=0.5, cold=0)
    _drive(guard, 40, draft_rate=6, plain_rate=2)
    assert guard.drafting(1)
    modes = _drive(guard, 80, draft_rate=1, plain_rate=2)  # the text stopped being predictable
    assert modes[-10:].count(False) >= 8


def test_guard_rejects_bad_settings():
    with pytest.raises(ValueError, match="period"):
        SpeculationGuard(period=0, cold=0)
    with pytest.raises(ValueError, match="alpha"):
        SpeculationGuard(alpha=0.0)


@pytest.mark.parametrize(
    "key, value", [("speculation_guard", "yes"), ("disable_by_batch_size", 0), ("disable_by_batch_size", True)]
)
def test_spec_config_rejects_bad_guard_keys(key, value):
    with pytest.raises(ConfigError, match=key):
        SpeculativeConfig.from_dict({"method": "dspark", key: value})


def _greedy(spec: SpeculativeConfig | None, guard: SpeculationGuard | None = None, seqs: int = 4):
    torch.manual_seed(0)
    target, drafter = build_tiny_pair(3)
    engine = Engine(target, drafter, spec, EngineConfig(dtype="float32", max_num_seqs=seqs))
    if guard is not None:
        engine.guard = guard
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (5, 17, 30)]
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (24, 16, 20)]
    outs = LLM.from_engine(engine).generate(prompts, params)
    return [o.token_ids for o in outs], engine


@pytest.mark.parametrize("method", ["dspark", "ngram"])
def test_guarded_speculation_emits_the_target_greedy_tokens(method):
    expected, _ = _greedy(None)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3, speculation_guard=True)
    got, engine = _greedy(spec, SpeculationGuard(period=1, probe=1, warmup=1, cold=0))  # switches modes every few steps
    assert got == expected
    modes = [(b.draft.steps, b.plain.steps) for b in engine.guard.buckets.values()]
    assert sum(d for d, _ in modes) > 0 and sum(p for _, p in modes) > 0  # both kinds of step ran


def test_disable_by_batch_size_skips_drafting_for_larger_steps_only():
    expected, _ = _greedy(None)
    spec = SpeculativeConfig(
        method="dspark", num_speculative_tokens=3, disable_by_batch_size=1, speculation_guard=False
    )
    torch.manual_seed(0)
    seen: dict[str, list[int]] = {"steps": [], "drafted": []}
    engine = Engine(*build_tiny_pair(3), spec, EngineConfig(dtype="float32", max_num_seqs=4))
    decode, propose = engine._decode, engine.runner.propose_draft

    def spy_decode(reqs):
        seen["steps"].append(len(reqs))
        return decode(reqs)

    def spy_propose(reqs, *a, **kw):
        seen["drafted"].append(len(reqs))
        return propose(reqs, *a, **kw)

    engine._decode, engine.runner.propose_draft = spy_decode, spy_propose
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (5, 17, 30)]
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (24, 16, 20)]
    got = [o.token_ids for o in LLM.from_engine(engine).generate(prompts, params)]
    assert got == expected
    assert max(seen["steps"]) > 1 and seen["drafted"] and set(seen["drafted"]) == {1}
    assert len(seen["drafted"]) == seen["steps"].count(1)  # every lone step drafted, no larger one did


# ---- on by default: a round that costs more than it repays switches drafting off, and generate says so --------------

SLOW_S = 0.05  # a drafter this slow cannot repay its round on a tiny model: at most K + 1 = 4 tokens per 50 ms


def _slow(propose):
    def slow_propose(*a, **kw):
        time.sleep(SLOW_S)
        return propose(*a, **kw)

    return slow_propose


def test_the_guard_is_on_by_default_and_switches_a_slow_drafter_off():
    assert SpeculativeConfig().speculation_guard is True
    expected, _ = _greedy(None)
    spec = SpeculativeConfig(method="dspark", num_speculative_tokens=3)
    torch.manual_seed(0)
    engine = Engine(*build_tiny_pair(3), spec, EngineConfig(dtype="float32", max_num_seqs=1))
    engine.runner.propose_draft = _slow(engine.runner.propose_draft)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (5, 17, 30)]
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (24, 16, 20)]
    got = [o.token_ids for o in LLM.from_engine(engine).generate(prompts, params)]
    assert got == expected  # switching never changes a greedy token
    rep = engine.guard.report()["1"]
    warmup, probe = engine.guard.warmup, engine.guard.probe
    assert rep["drafting"] is False and rep["switched_off_at_step"] == warmup + probe
    assert rep["plain_steps"] > rep["draft_steps"]
    (line,) = guard_lines(engine)
    assert line.startswith(f"speculation guard: batch size 1: drafting switched off at step {warmup + probe}: ")
    assert "a round costs more than its accepted tokens repay" in line


def test_a_step_with_a_seeded_sampled_request_always_drafts():
    spec = SpeculativeConfig(method="dspark", num_speculative_tokens=3)
    torch.manual_seed(0)
    engine = Engine(*build_tiny_pair(3), spec, EngineConfig(dtype="float32", max_num_seqs=1))
    engine.runner.propose_draft = _slow(engine.runner.propose_draft)
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    LLM.from_engine(engine).generate([[4, 5, 6, 7]], params)
    assert engine.guard.buckets == {}  # never consulted: its output must not depend on the machine's timing
    assert engine.metrics.spec.num_drafts > 0


def test_generate_prints_why_drafting_was_switched_off(tmp_path, capsys, monkeypatch):
    from dspark.engine.runner import ModelRunner
    from dspark.models.tiny import write_tiny_pair

    target_dir, draft_dir = write_tiny_pair(tmp_path)
    monkeypatch.setattr(ModelRunner, "propose_draft", _slow(ModelRunner.propose_draft))
    spec = json.dumps({"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 3})
    argv = ["generate", "abc", "--model", str(target_dir), "--speculative-config", spec, "--dtype", "float32"]
    assert main([*argv, "--max-tokens", "40", "--no-compare"]) == 0
    err = capsys.readouterr().err
    g = SpeculationGuard()  # the timed run's guard starts afresh; its steps count the warm ones (cold ones left out)
    step = g.warmup + g.probe
    assert f"speculation guard: batch size 1: drafting switched off at step {step}: " in err, err
    assert main([*argv, "--max-tokens", "40", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["speculation_guard"]
    assert report["1"]["drafting"] is False and report["1"]["switched_off_at_step"] == step
    off = json.dumps({"method": "dspark", "model": str(draft_dir), "speculation_guard": False})
    assert main([*argv[:4], "--speculative-config", off, "--max-tokens", "4", "--no-compare"]) == 0
    assert "speculation guard: off (speculation_guard false): every step drafts" in capsys.readouterr().err


# ---- a step that does not draft defers the drafter's context projection -------------------------------------------


class _EveryThird:
    """A deterministic guard: drafts on every third decode step (so plain steps keep context rows deferred)."""

    def __init__(self) -> None:
        self.steps = 0

    def drafting(self, batch_size: int) -> bool:
        return self.steps % 3 == 2

    def observe(self, batch_size: int, drafted: bool, tokens: int, seconds: float) -> None:
        self.steps += 1


@pytest.mark.parametrize("caching", [False, True])
def test_deferred_drafter_context_writes_what_immediate_injection_writes(caching, monkeypatch):
    import dspark.engine.runner as runner_mod
    from dspark.config import CacheConfig

    expected, _ = _greedy(None)
    monkeypatch.setattr(runner_mod, "DEFER_ROWS", 5)  # a request's fifth kept row flushes every kept row

    def run(defer: bool):
        torch.manual_seed(0)
        spec = SpeculativeConfig(method="dspark", num_speculative_tokens=3)
        cache = CacheConfig(page_size=4, enable_prefix_caching=caching)
        engine = Engine(*build_tiny_pair(3), spec, EngineConfig(dtype="float32", max_num_seqs=4), cache)
        engine.guard = _EveryThird()
        forward, propose = engine.runner.target_forward, engine.runner.propose_draft
        seen: list[tuple[list[list[int]], torch.Tensor]] = []

        def spy_forward(*a, defer_context=False, **kw):
            return forward(*a, defer_context=defer_context and defer, **kw)

        def spy_propose(reqs, *a, **kw):
            proposal = propose(reqs, *a, **kw)  # reads the context rows after flushing the kept ones
            seen.append((proposal.tokens.tolist(), engine.pools.draft.pool.clone()))
            return proposal

        engine.runner.target_forward, engine.runner.propose_draft = spy_forward, spy_propose
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (5, 17, 30)]
        params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (24, 16, 20)]
        got = [o.token_ids for o in LLM.from_engine(engine).generate(prompts, params)]
        assert engine.runner._deferred == {}  # finished requests leave nothing kept
        return got, seen

    (got, deferred), (ref, immediate) = run(True), run(False)
    assert got == ref == expected
    assert len(deferred) == len(immediate) > 3
    for (tokens, pool), (ref_tokens, ref_pool) in zip(deferred, immediate):
        assert tokens == ref_tokens
        torch.testing.assert_close(pool, ref_pool, rtol=1e-5, atol=1e-5)


def test_cold_first_steps_do_not_decide():
    """The first rounds and plain steps of a bucket pay one-time costs (new shapes): they are left out of the rates,
    so a drafter that pays once warm is not switched off by its slow first rounds."""

    def run(cold: int) -> tuple[SpeculationGuard, list[bool]]:
        guard, modes = SpeculationGuard(period=8, probe=2, warmup=4, cold=cold), []
        for i in range(40):
            drafting = guard.drafting(1)
            modes.append(drafting)
            seconds = 10.0 if i < 2 else 1.0  # the first two steps are cold (rounds: drafting leads first)
            guard.observe(1, drafting, 3 if drafting else 1, seconds)
        return guard, modes

    guard, modes = run(cold=2)
    assert guard.buckets[1].off_at is None and guard.buckets[1].leader_drafts
    assert guard.buckets[1].draft.steps == sum(modes) - 2  # the cold rounds hold no weight
    counted, _ = run(cold=0)  # counting them, the same steps switch drafting off at the first probe
    assert counted.buckets[1].off_at is not None
    assert SpeculationGuard(cold=0).cold == 0
    with pytest.raises(ValueError):
        SpeculationGuard(cold=-1)


def test_warm_up_runs_the_first_shapes_and_forgets_them():
    """serve warms the engine before its first client: a prefill and a few rounds ran, yet the counters, the guard
    and the pool are as a fresh engine's, and a greedy request's tokens are unchanged."""
    from dspark.llm import warm_up

    spec = SpeculativeConfig(num_speculative_tokens=3)
    fresh = Engine(*build_tiny_pair(3), spec, EngineConfig(dtype="float32"))
    warm = Engine(*build_tiny_pair(3), spec, EngineConfig(dtype="float32"))
    free = warm.num_pages_free
    warm_up(warm)
    assert warm.metrics.generation_tokens == 0 and warm.metrics.spec.num_drafts == 0
    assert warm.guard is not None and warm.guard.buckets == {}
    assert warm.num_pages_free == free and not warm.has_unfinished
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = [[4, 5, 6, 7, 8]]
    got = LLM.from_engine(warm).generate(ids, params)[0].token_ids
    assert got == LLM.from_engine(fresh).generate(ids, params)[0].token_ids
