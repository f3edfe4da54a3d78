"""Confidence-scheduled verification: losslessness with Algorithm 1 on, cost-table profiling, STS calibration,
and how the engine finds its calibration/cost files."""

import json
import warnings

import pytest
import torch

from dspark.bench.profile import ProfileConfig, non_increasing_fit, profile_sps, save_profile, table_from_measurements
from dspark.cli import main
from dspark.config import CacheConfig, ConfigError, EngineConfig, SpeculativeConfig
from dspark.engine import engine as engine_mod
from dspark.engine.engine import AdaptivePolicy, Engine, load_adaptive
from dspark.llm import LLM, build_engines, engine_configs
from dspark.models.tiny import build_tiny_pair, tiny_draft_config, tiny_target_config, write_tiny_pair
from dspark.sampling_params import SamplingParams
from dspark.speculative.schedule import SpsTable, default_cost_model, save_sts
from dspark.train.calibrate import collect

# Algorithm 1 picks 0, 1 and 2 drafts under this table on the tiny pairs (the anchor slot is cheap next to the
# fixed per-step cost, so admission stops near survival ~0.3)
VARIED = default_cost_model(base_ms=50.0, per_token_ms=0.2, per_request_ms=0.05, max_tokens=512, batch_sizes=(1, 64))


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run ~10x faster on one thread than on two busy shared cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def prompts_for(seed, n):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (n,), generator=g).tolist()
    return [torch.randint(4, 96, (ln,), generator=g).tolist() for ln in lengths]


# ---- losslessness with the scheduler on ---------------------------------------------------------------------------


def _exact_three_token_distribution(target, prompt, V):
    """p(t1, t2, t3 | prompt) computed directly from the target (temperature 1)."""
    with torch.no_grad():
        p1 = target(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        p2 = target(torch.tensor([prompt + [a] for a in range(V)])).logits[:, -1].softmax(-1)
        rows = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3 = target(rows).logits[:, -1].softmax(-1).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def _chi_square(counts, expected):
    big = expected >= 5
    obs = torch.cat((counts[big], counts[~big].sum()[None]))
    exp = torch.cat((expected[big], expected[~big].sum()[None]))
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def _biased_lengths(engine, token):
    """A broken scheduler: drafted token x_1 itself decides whether x_1 (and x_2) are verified."""

    def lengths(reqs, proposal):
        return [min(2, r.remaining_tokens) if int(proposal.tokens[i, 0]) == token else 0 for i, r in enumerate(reqs)]

    engine._verify_lengths = lengths


@pytest.mark.parametrize("biased", [False, True])
def test_sampled_output_matches_target_distribution_with_scheduler(biased):
    V = 10
    tcfg = tiny_target_config(vocab_size=V, moe=False)
    target, drafter = build_tiny_pair(5, tcfg, tiny_draft_config(tcfg, markov_rank=4))
    with torch.no_grad():  # soften the target so many tokens have real mass
        target.lm_head.weight.mul_(0.25)
    prompt = [0, 5, 6]
    exact = _exact_three_token_distribution(target, prompt, V)
    n = 3000
    spec = SpeculativeConfig(method="dspark", num_speculative_tokens=3, enable_adaptive_verification=True)
    # sharpened confidences (T < 1) spread the survivals, so Algorithm 1 trims blocks at varied lengths
    policy = AdaptivePolicy(temperatures=[0.3, 0.3, 0.3], sps=VARIED, min_len=0)
    eng = Engine(
        target,
        drafter,
        spec,
        EngineConfig(dtype="float32", max_num_seqs=64),
        CacheConfig(num_pages=1024, page_size=4),
        adaptive=policy,
    )
    if biased:
        _biased_lengths(eng, token=7)  # 7: the drafter's most frequent first token after this prompt
    # max_tokens=3: t1 from the prefill, then a round anchored at t1 verifies d_1, d_2 (c_2 depends on d_1)
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True) for s in range(n)]
    outs = LLM.from_engine(eng).generate([prompt] * n, params)
    counts = torch.zeros(V, V, V)
    for o in outs:
        counts[tuple(o.token_ids)] += 1
    stat, dof = _chi_square(counts.flatten(), (exact * n).flatten())
    bound = dof + 4 * (2 * dof) ** 0.5  # ~4 sigma
    m = eng.metrics.spec
    assert m.num_draft_tokens > 0
    if biased:  # power: the test detects a selection-biased verify length
        assert stat > bound, (stat, dof)
        return
    assert stat < bound, (stat, dof)
    assert {0, 1, 2} <= set(m.verify_len_hist), m.verify_len_hist  # the scheduler really trimmed, variably


# ---- greedy equality through the real loading path -------------------------------------------------------------


def _write_pair_with_files(tmp_path, seed, k):
    tcfg = tiny_target_config(moe=seed != 1, q_lora_rank=None if seed == 2 else 24)
    dcfg = tiny_draft_config(tcfg, head_type=["vanilla", "gated", "rnn"][seed])
    target_dir, draft_dir = write_tiny_pair(tmp_path / f"pair{seed}", seed, target_cfg=tcfg, draft_cfg=dcfg)
    save_sts(draft_dir / "sts_calibration.json", [0.4] * k)
    VARIED.save(target_dir / "sps_profile.json")
    return target_dir, draft_dir


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_adaptive_equals_target_only(tmp_path, seed):
    k = [3, 5, 7][seed]
    target_dir, draft_dir = _write_pair_with_files(tmp_path, seed, k)
    spec = {"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": k}
    spec["enable_adaptive_verification"] = True
    spec["draft_sample_method"] = ["probabilistic", "greedy", "probabilistic"][seed]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # both files are found: no fallback warning
        adaptive, plain = build_engines(target_dir, [spec, None], *engine_configs(dtype="float32", max_num_seqs=8))
    assert adaptive.adaptive is not None and adaptive.adaptive.temperatures == [0.4] * k
    verify_calls = []
    inner = adaptive._verify
    adaptive._verify = lambda *a: verify_calls.append(1) or inner(*a)
    prompts = prompts_for(seed, 6)
    params = [SamplingParams(temperature=0, max_tokens=10 + 4 * i, stop_token_ids=(7 + i,)) for i in range(6)]
    ref = [o.token_ids for o in LLM.from_engine(plain).generate(prompts, params)]
    outs = LLM.from_engine(adaptive).generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    m = adaptive.metrics.spec
    assert len(set(m.verify_len_hist)) >= 2, m.verify_len_hist  # lengths vary
    # the histogram counts one verify length per request per round; steps count once per engine step
    # (a request step the scheduler gave no draft token is not a draft, as in vLLM)
    assert sum(m.verify_len_hist.values()) == m.num_drafts + m.num_undrafted
    assert m.num_drafts == sum(o.spec_metrics["num_drafts"] for o in outs)
    assert m.num_draft_tokens == sum(n * c for n, c in m.verify_len_hist.items())
    assert m.verify_tokens == sum((n + 1) * c for n, c in m.verify_len_hist.items())
    assert m.num_steps == len(verify_calls) < m.num_drafts
    assert m.verify_tokens / m.num_steps == pytest.approx(m.verify_tokens / len(verify_calls))  # rows per step


# ---- finding the calibration and cost files ----------------------------------------------------------------------


def _dirs(tmp_path):
    draft, target = tmp_path / "draft", tmp_path / "target"
    draft.mkdir()
    target.mkdir()
    return draft, target


def _load(spec, draft, target):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy = load_adaptive(spec, draft, target)
    return policy, [w for w in caught if "adaptive verification" in str(w.message)]


def test_load_adaptive_finds_files_next_to_draft_and_target(tmp_path):
    draft, target = _dirs(tmp_path)
    spec = SpeculativeConfig(num_speculative_tokens=3, enable_adaptive_verification=True, min_verify_len=1)
    save_sts(draft / "sts_calibration.json", [0.5, 1.0, 2.0])
    table = default_cost_model(base_ms=7.0, max_tokens=16)
    table.save(target / "sps_profile.json")
    policy, warned = _load(spec, draft, target)
    assert not warned
    assert policy.temperatures == [0.5, 1.0, 2.0] and policy.sps == table and policy.min_len == 1
    # the draft dir's table is the fallback for the cost table, the target's for the temperatures
    (target / "sps_profile.json").rename(draft / "sps_profile.json")
    (draft / "sts_calibration.json").rename(target / "sts_calibration.json")
    policy, warned = _load(spec, draft, target)
    assert not warned and policy.temperatures == [0.5, 1.0, 2.0] and policy.sps == table


def test_load_adaptive_config_paths_win(tmp_path):
    draft, target = _dirs(tmp_path)
    save_sts(draft / "sts_calibration.json", [9.0, 9.0])
    default_cost_model().save(target / "sps_profile.json")
    save_sts(tmp_path / "mine.json", [0.7, 0.8])
    table = default_cost_model(base_ms=3.0, max_tokens=8)
    table.save(tmp_path / "costs.json")
    spec = SpeculativeConfig(
        num_speculative_tokens=2,
        enable_adaptive_verification=True,
        calibration_path=str(tmp_path / "mine.json"),
        cost_table_path=str(tmp_path / "costs.json"),
    )
    policy, warned = _load(spec, draft, target)
    assert not warned and policy.temperatures == [0.7, 0.8] and policy.sps == table


def test_load_adaptive_missing_files_fall_back_with_one_warning(tmp_path):
    draft, target = _dirs(tmp_path)
    spec = SpeculativeConfig(num_speculative_tokens=3, enable_adaptive_verification=True)
    policy, warned = _load(spec, draft, target)
    assert len(warned) == 1
    assert "dspark calibrate" in str(warned[0].message) and "dspark profile" in str(warned[0].message)
    assert policy.temperatures is None and policy.sps == default_cost_model()
    save_sts(draft / "sts_calibration.json", [1.0, 1.0, 1.0])  # only the cost table missing: still one warning
    policy, warned = _load(spec, draft, target)
    assert len(warned) == 1 and "dspark calibrate" not in str(warned[0].message)
    assert policy.temperatures == [1.0, 1.0, 1.0]


def test_build_engine_without_files_warns_once_and_still_decodes(tmp_path):
    target_dir, draft_dir = write_tiny_pair(tmp_path / "pair", 3)
    spec = {"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 3}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        specs = [{**spec, "enable_adaptive_verification": True}]
        (eng,) = build_engines(target_dir, specs, *engine_configs(dtype="float32"))
        out = LLM.from_engine(eng).generate([[0, 4, 5]], SamplingParams(temperature=0, max_tokens=8))
    assert len([w for w in caught if "adaptive verification" in str(w.message)]) == 1
    assert len(out[0].token_ids) == 8 and eng.metrics.spec.num_drafts > 0


def test_load_adaptive_bad_inputs_are_clear_errors(tmp_path):
    draft, target = _dirs(tmp_path)
    spec = SpeculativeConfig(
        num_speculative_tokens=3, enable_adaptive_verification=True, calibration_path=str(tmp_path / "nope.json")
    )
    with pytest.raises(ConfigError, match="calibration_path"):
        load_adaptive(spec, draft, target)
    save_sts(draft / "sts_calibration.json", [1.0, 1.0])  # fitted for K=2, serving K=3
    spec = SpeculativeConfig(num_speculative_tokens=3, enable_adaptive_verification=True)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        load_adaptive(spec, draft, target)


# ---- dspark profile -------------------------------------------------------------------------------------------


def test_non_increasing_fit():
    assert non_increasing_fit([5.0, 4.0, 4.0, 1.0]) == [5.0, 4.0, 4.0, 1.0]
    assert non_increasing_fit([1.0, 3.0]) == [2.0, 2.0]
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ys = torch.rand(9, generator=g).tolist()
        fit = non_increasing_fit(ys)
        assert all(a >= b - 1e-12 for a, b in zip(fit, fit[1:]))
        assert sum(fit) == pytest.approx(sum(ys))  # the least-squares fit keeps the mean of each pooled block


def test_table_from_measurements_interpolates_each_row_on_a_shared_grid():
    measured = {1: [(1, 0.010), (2, 0.020)], 2: [(2, 0.016), (4, 0.032)]}
    t = table_from_measurements(measured, monotone=False)
    assert t.batch_sizes == (1.0, 2.0) and t.num_tokens == (1.0, 2.0, 4.0)
    assert t.steps_per_s[0] == pytest.approx((100.0, 50.0, 50.0))  # flat beyond its own range
    assert t.steps_per_s[1] == pytest.approx((62.5, 62.5, 31.25))
    assert t.sps(3, batch_size=2) == pytest.approx((62.5 + 31.25) / 2)  # linear, not a floor lookup


def test_profile_measures_the_runner_and_writes_a_loadable_table(tmp_path):
    target, drafter = build_tiny_pair(0)
    cfg = ProfileConfig(batch_sizes=(1, 3), max_tokens_per_request=3, context_len=12, repeats=2, warmup=1)
    result = profile_sps(target, drafter, cfg)
    assert sorted(result.measured) == [1, 3]
    assert [b for b, _ in result.measured[3]] == [3, 6, 9]
    assert all(s > 0 for pts in result.measured.values() for _, s in pts)
    save_profile(tmp_path / "sps.json", result, {"note": "test"})
    table = SpsTable.load(tmp_path / "sps.json")
    assert table == result.table and table.is_2d and table.num_tokens == (1.0, 2.0, 3.0, 6.0, 9.0)
    for row in table.steps_per_s:
        assert all(v > 0 for v in row) and all(a >= b for a, b in zip(row, row[1:]))


def test_profile_cli(tmp_path, capsys):
    target_dir, draft_dir = write_tiny_pair(tmp_path / "pair", 0)
    out = tmp_path / "sps_profile.json"
    argv = ["profile", "--model", str(target_dir), "--output", str(out), "--batch-sizes", "1,2"]
    argv += ["--max-tokens-per-request", "2", "--context-len", "8", "--repeats", "1", "--dtype", "float32", "--quiet"]
    assert main(argv) == 0
    table = SpsTable.load(out)
    assert table.batch_sizes == (1.0, 2.0) and table.num_tokens == (1.0, 2.0, 4.0)
    meta = json.loads(out.read_text())["meta"]
    assert meta["draft"] is None and meta["context_len"] == 8
    assert "sps_profile.json" in capsys.readouterr().out


# ---- dspark calibrate ---------------------------------------------------------------------------------------------


def test_recorder_matches_the_acceptance_rule(monkeypatch):
    target, drafter = build_tiny_pair(1)
    K = 3
    eng = Engine(target, drafter, SpeculativeConfig(num_speculative_tokens=K), EngineConfig(dtype="float32"))
    seen = []  # (verify lengths, accepted, confidence) straight from the acceptance rule
    real_accept = engine_mod.accept

    def spy(proposal, lengths, *rest):
        res = real_accept(proposal, lengths, *rest)
        seen.append((lengths.tolist(), res.num_accepted.tolist(), proposal.confidence.tolist()))
        return res

    monkeypatch.setattr(engine_mod, "accept", spy)
    data = collect(eng, prompts_for(1, 4), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    full = [(z, n) for lens, acc, conf in seen for ell, n, z in zip(lens, acc, conf) if ell == K]
    assert len(full) < sum(len(lens) for lens, _, _ in seen)  # some rounds were capped and must be skipped
    assert data.logits == [z for z, _ in full] and data.accepted == [n for _, n in full]
    assert eng._accept_and_commit.__func__ is Engine._accept_and_commit  # detached afterwards
    eng.adaptive = AdaptivePolicy(None, VARIED, 0)
    with pytest.raises(ValueError, match="adaptive"):  # trimmed blocks would clip the labels
        collect(eng, [[0, 4]], SamplingParams(temperature=0, max_tokens=4))


def test_calibrate_cli_end_to_end(tmp_path, capsys):
    target_dir, draft_dir = write_tiny_pair(tmp_path / "pair", 0)
    dataset = tmp_path / "calib.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(x):", "hello", "1 2 3", "abc"]))
    out, png = tmp_path / "sts.json", tmp_path / "rel.png"
    spec = json.dumps({"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 3})
    argv = ["calibrate", "--dataset", str(dataset), "--model", str(target_dir), "--speculative-config", spec]
    argv += ["--max-tokens", "16", "--output", str(out), "--plot", str(png), "--dtype", "float32"]
    argv += ["--temperature", "1.0"]
    assert main(argv) == 0
    saved = json.loads(out.read_text())
    temps = saved["sts_temperatures"]
    assert len(temps) == 3 and all(t > 0 for t in temps)
    assert [r["position"] for r in saved["per_position"]] == [1, 2, 3] and saved["num_rounds"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "ECE" in printed and "AUROC" in printed and "Brier" in printed
    # the file dropped next to the draft is what adaptive verification then uses
    (draft_dir / "sts_calibration.json").write_text(out.read_text())
    policy, _ = _load(SpeculativeConfig(num_speculative_tokens=3), draft_dir, target_dir)
    assert policy.temperatures == temps


def test_calibrate_and_profile_write_where_the_engine_looks(tmp_path, capsys, monkeypatch):
    """Without --output, calibrate and profile write into the pair's tuning dir under $DSPARK_CACHE (never into the
    package), the engine takes those files before any next to the models, and a thin sample is warned about."""
    from dspark.tuning import SPS_FILE, STS_FILE, tuning_dir

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    target_dir, draft_dir = write_tiny_pair(tmp_path / "pair", 0)
    save_sts(draft_dir / STS_FILE, [9.0, 9.0, 9.0])  # a shipped file: the measured one must win
    dataset = tmp_path / "calib.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(x):", "hello"]))
    spec = json.dumps({"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 3})
    argv = ["calibrate", "--dataset", str(dataset), "--model", str(target_dir), "--speculative-config", spec]
    assert main([*argv, "--max-tokens", "8", "--dtype", "float32"]) == 0
    out = capsys.readouterr()
    where = tuning_dir(draft_dir, target_dir)
    assert f"wrote {where / STS_FILE}" in out.out and "from now on" in out.out
    assert "were reached by fewer than" in out.err and "--num-prompts" in out.err
    argv = ["profile", "--model", str(target_dir), "--draft", str(draft_dir), "--batch-sizes", "1"]
    argv += ["--max-tokens-per-request", "2", "--context-len", "8", "--repeats", "1", "--dtype", "float32", "--quiet"]
    assert main(argv) == 0
    assert (where / SPS_FILE).is_file() and not (target_dir / SPS_FILE).exists()
    policy, _ = _load(SpeculativeConfig(num_speculative_tokens=3), draft_dir, target_dir)
    assert policy.temperatures == json.loads((where / STS_FILE).read_text())["sts_temperatures"]
    assert policy.temperatures != [9.0, 9.0, 9.0]
