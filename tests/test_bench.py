"""dspark bench: schema of the JSON, numbers from the engine's counters, τ = K+1 with a perfect drafter, held-out
prompts, context padding, and the vLLM worker protocol (with a fake vllm module)."""

import json
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from dspark.bench.acceptance import SpecCounters
from dspark.bench.datasets import (
    HELDOUT,
    HELDOUT_SOURCES,
    BenchPrompt,
    build_heldout,
    pad_to_depth,
    read_sources,
)
from dspark.bench.speed import RESULT_KEYS, Cell, EngineMethod, measure_parts, rows_from_measurements
from dspark.config import EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.engine.metrics import SpecDecodingMetrics
from dspark.llm import LLM
from dspark.models.tiny import build_tiny_pair, write_tiny_pair
from dspark.sampling_params import SamplingParams
from dspark.speculative.propose import Proposal


def measure_cell(methods, cell: Cell, params: SamplingParams):
    """One row per method, the methods run round-robin over the cell's batches (``ar`` is the speed-up reference)."""
    return rows_from_measurements(measure_parts(methods, cell, params), cell)


@pytest.fixture(autouse=True)
def one_thread():
    # tiny models: one thread avoids OpenMP contention on the shared 2-core machine
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- counters ----


def test_spec_counters_delta_and_rates_match_hand_computation():
    m = SpecDecodingMetrics()
    m.record(3, 1)
    before = SpecCounters.of(m)
    records = [(4, 4), (2, 0), (0, 0), (4, 2)]  # (verify length L, accepted n)
    for L, n in records:
        m.record(L, n)
    d = SpecCounters.of(m) - before
    # the L = 0 step verified a row but drafted nothing: not a draft (vLLM semantics)
    assert d.num_drafts == 3 and d.num_undrafted == 1 and d.num_accepted_tokens == 6 and d.num_draft_tokens == 10
    assert d.acceptance_length == pytest.approx(1 + 6 / 3)
    assert d.per_position_acceptance == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])
    assert d.verify_rate == pytest.approx(sum(n + 1 for _, n in records) / sum(L + 1 for L, _ in records))
    assert (before + d) == SpecCounters.of(m)
    assert SpecCounters().acceptance_length is None and SpecCounters().verify_rate is None


def test_a_step_without_draft_tokens_is_not_a_draft_as_in_vllm():
    """An n-gram miss (or an adaptive L = 0) verifies one row but proposes nothing: counting it as a draft would
    dilute τ and the per-position rates against vLLM's counters, which skip such steps."""
    m = SpecDecodingMetrics()
    for L, n in [(4, 4), (0, 0), (4, 2), (0, 0)]:
        m.record(L, n)
    c = SpecCounters.of(m)
    assert c.num_drafts == 2 and c.num_undrafted == 2 and c.num_draft_tokens == 8
    assert c.acceptance_length == pytest.approx(1 + 6 / 2) == m.acceptance_length
    assert c.per_position_acceptance == pytest.approx([1.0, 1.0, 0.5, 0.5])
    assert c.verify_rate == pytest.approx((5 + 3 + 1 + 1) / (5 + 1 + 5 + 1))  # Σ(n+1) / Σ(L+1) over all steps
    assert m.verify_len_hist[0] == 2


# ---- perfect drafter ----


FP32 = EngineConfig(dtype="float32", max_num_seqs=4)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple([0, *torch.randint(4, 96, (int(L),), generator=g).tolist()]) for L in (5, 9, 13, 7)[:n]]


def _perfect(engine, reference):
    """Drafts = the target's own greedy continuation, looked up in a separate target-only run of the prompt."""
    K = engine.K

    def propose(reqs, sampling, probabilistic, use_markov, topk):
        tokens = torch.zeros(len(reqs), K, dtype=torch.long)
        for i, r in enumerate(reqs):
            full = list(r.prompt_ids) + reference[tuple(r.prompt_ids)]
            nxt = full[r.num_computed + 1 : r.num_computed + 1 + K]
            tokens[i, : len(nxt)] = torch.tensor(nxt, dtype=torch.long)
        return Proposal(tokens, torch.full((len(reqs),), K, dtype=torch.long), None, None)

    engine.runner.propose_draft = propose
    return engine


def _perfect_setup(K, max_tokens, prompts):
    target, drafter = build_tiny_pair(0)
    ar = Engine(target, None, None, FP32)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = LLM.from_engine(Engine(target, None, None, FP32)).generate([list(p) for p in prompts], params)
    reference = {p: o.token_ids for p, o in zip(prompts, outs)}
    spec = SpeculativeConfig(
        method="dspark",
        num_speculative_tokens=K,
        draft_sample_method="greedy",
        rejection_sample_method="standard",
        speculation_guard=False,  # every step drafts: three full rounds
    )
    perfect = _perfect(Engine(target, drafter, spec, FP32), reference)
    return ar, perfect, params


@pytest.mark.parametrize("K,concurrency", [(3, 2), (5, 1)])
def test_perfect_drafter_gives_tau_k_plus_one(K, concurrency):
    prompts = _prompts(4 if concurrency == 2 else 2)
    max_tokens = 1 + 3 * (K + 1)  # first token from prefill, then three full rounds of K+1
    ar, perfect, params = _perfect_setup(K, max_tokens, prompts)
    rows = measure_cell(
        [EngineMethod("ar", ar), EngineMethod("perfect", perfect)],
        Cell("synthetic", 0.0, concurrency, tuple(prompts)),
        params,
    )
    by = {r.name: r for r in rows}
    assert by["perfect"].acceptance_length == K + 1
    assert by["perfect"].per_position_acceptance == [1.0] * K
    assert by["perfect"].verify_rate == 1.0
    assert by["perfect"].output_tokens == by["ar"].output_tokens == len(prompts) * max_tokens
    assert by["ar"].speedup_vs_ar == 1.0 and by["ar"].acceptance_length is None and by["ar"].verify_rate is None
    assert by["ar"].tau_bound is None and by["perfect"].tau_bound > 0  # from the engines' measured phase times
    assert by["ar"].decode_speedup_vs_ar == 1.0 and by["perfect"].decode_speedup_vs_ar > 0


def test_decode_speedup_counts_decode_tokens_over_decode_time_only():
    """Prefill excluded: each request's first token comes from its prefill step; stacks without phase times get
    no decode speed-up."""
    from dspark.bench.methods import Measurement
    from dspark.bench.speed import rows_from_measurements
    from dspark.engine.metrics import DecodeTimes

    ar = [Measurement(20, 30.0, None, DecodeTimes(18, 0.0, 9.0, 9.0), requests=2)]  # 18 tokens / 9 s
    spec = [Measurement(20, 24.0, None, DecodeTimes(4, 1.0, 2.0, 3.0), requests=2)]  # 18 tokens / 3 s
    other = [Measurement(20, 10.0, None)]
    rows = rows_from_measurements({"ar": ar, "dspark": spec, "hf-generate": other}, Cell("x", 0.0, 2, ((1,), (2,))))
    by = {r.name: r for r in rows}
    assert by["dspark"].decode_speedup_vs_ar == pytest.approx(3.0)
    assert by["dspark"].speedup_vs_ar == pytest.approx(30.0 / 24.0)  # end to end: prefill included
    assert by["ar"].decode_speedup_vs_ar == 1.0 and by["hf-generate"].decode_speedup_vs_ar is None


def test_prefill_and_decode_rates_are_reported_per_phase_and_against_llama_cpp():
    """Each row's prefill rate is prompt tokens over prefill seconds and its decode rate output tokens after the
    first over decode seconds; the note compares each of our methods with llama.cpp phase by phase."""
    from dspark.bench.methods import Measurement
    from dspark.bench.speed import phase_notes, rows_from_measurements
    from dspark.engine.metrics import DecodeTimes, PrefillTimes

    ar = [Measurement(20, 12.0, None, DecodeTimes(18, 0.0, 9.0, 9.0), 2, PrefillTimes(2, 300, 3.0))]
    peer = [Measurement(20, 13.0, None, DecodeTimes(18, 0.0, 6.0, 6.0), 2, PrefillTimes(2, 300, 6.0))]
    other = [Measurement(20, 10.0, None)]
    cell = Cell("x", 0.0, 1, ((1,), (2,)))
    rows = rows_from_measurements({"ar": ar, "llama-cpp": peer, "hf-generate": other}, cell)
    by = {r.name: r for r in rows}
    assert by["ar"].prefill_tokens_per_s == pytest.approx(100.0) and by["ar"].decode_tokens_per_s == pytest.approx(2.0)
    assert by["llama-cpp"].decode_tokens_per_s == pytest.approx(3.0) and by["hf-generate"].prefill_tokens_per_s is None
    (note,) = phase_notes(rows)
    assert "ar prefill 2.00x, decode 0.67x, whole request 1.08x" in note and "hf-generate" not in note


def test_rows_are_computed_from_engine_counter_deltas():
    """The counters are deliberately skewed (one accepted token is dropped from every record): the row must report
    the counters' τ, not the K+1 that the generated tokens would suggest."""
    K, max_tokens = 3, 9
    prompts = _prompts(3, seed=1)
    ar, perfect, params = _perfect_setup(K, max_tokens, prompts)
    true_record = perfect.metrics.spec.record
    perfect.metrics.spec.record = lambda L, n: true_record(L, max(n - 1, 0))
    perfect.metrics.generation_tokens += 1000  # earlier work must not leak into the row (deltas only)
    before = SpecCounters.of(perfect.metrics.spec)
    gen0 = perfect.metrics.generation_tokens
    rows = measure_cell(
        [EngineMethod("perfect", perfect), EngineMethod("ar", ar)],
        Cell("synthetic", 0.0, 2, tuple(prompts)),
        params,
    )
    by = {r.name: r for r in rows}
    delta = SpecCounters.of(perfect.metrics.spec) - before
    row = by["perfect"]
    assert row.acceptance_length == delta.acceptance_length == K  # 1 + (K - 1) per draft, not K + 1
    assert row.per_position_acceptance == delta.per_position_acceptance
    assert row.verify_rate == delta.verify_rate
    assert row.output_tokens == perfect.metrics.generation_tokens - gen0 == len(prompts) * max_tokens
    assert row.tokens_per_s == row.output_tokens / row.wall_s
    assert row.speedup_vs_ar == row.tokens_per_s / by["ar"].tokens_per_s


# ---- the CLI end to end ----


def _check_row_types(row):
    assert tuple(row) == RESULT_KEYS
    assert isinstance(row["name"], str) and isinstance(row["dataset"], str)
    assert type(row["temperature"]) is float
    for k in ("concurrency", "num_prompts", "output_tokens"):
        assert type(row[k]) is int, k
    for k in ("wall_s", "tokens_per_s", "speedup_vs_ar"):
        assert type(row[k]) is float, k
    for k in ("acceptance_length", "verify_rate"):
        assert row[k] is None or type(row[k]) is float, k
    pos = row["per_position_acceptance"]
    assert pos is None or (isinstance(pos, list) and all(type(p) is float for p in pos))


def test_bench_cli_end_to_end_writes_schema_json_and_png(tmp_path, capsys):
    from dspark.cli import main
    from dspark.speculative.schedule import save_sts

    target_dir, draft_dir = write_tiny_pair(tmp_path / "pair")
    save_sts(draft_dir / "sts_calibration.json", [1.0] * 7)  # enables dspark-adaptive
    data = tmp_path / "prompts.jsonl"
    long = "class A:\n" + "    x = 1\n" * 60  # 609 bytes: longer than the tiny target's 512 positions allow
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def f(x):\n", long)))
    more = tmp_path / "more.jsonl"  # a second dataset: its own row group
    more.write_text(json.dumps({"prompt": "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n"}) + "\n")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "--dataset", f"{data},{more}", "--model", str(target_dir), "--draft", str(draft_dir)]
    argv += ["--num-prompts", "2", "--max-tokens", "5", "--temperature", "0,1", "--concurrency", "1,2"]
    argv += ["--context-depths", "40,80", "--context-prompts", "2", "--num-speculative-tokens", "3"]
    argv += ["--dtype", "float32", "--ignore-eos", "--quiet", "--output", str(out), "--plot", str(png)]
    with warnings.catch_warnings():  # load_adaptive warns: no cost table next to the pair
        warnings.simplefilter("ignore")
        assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "| method |" in stdout and "| dspark |" in stdout

    report = json.loads(out.read_text())
    assert set(report) == {"config", "results"}
    assert isinstance(report["config"], dict)
    assert any("1 prompt(s) longer than 503 tokens" in n for n in report["config"]["notes"])
    rows = report["results"]
    for row in rows:
        _check_row_types(row)
        assert row["output_tokens"] == row["num_prompts"] * 5  # --ignore-eos: every method emits max_tokens
        assert row["num_prompts"] == (1 if row["dataset"] == "more.jsonl" else 2)
    names = {r["name"] for r in rows}
    expected = {"ar", "dspark", "dflash (head off)", "ngram", "hf-generate", "hf-prompt-lookup", "dspark-adaptive"}
    expected |= {"dspark-guard"}  # what serve runs by default
    assert names == expected
    for r in rows:
        if r["name"] == "ar":
            assert r["speedup_vs_ar"] == 1.0
        if r["name"] == "dspark-guard":  # drafts only while drafting pays: a cell may hold no rounds at all
            continue
        spec = r["name"] in {"dspark", "dflash (head off)", "ngram", "dspark-adaptive"}
        assert (r["acceptance_length"] is not None) == spec, r["name"]
        assert (r["verify_rate"] is not None) == spec
    cells = {(r["dataset"], r["temperature"], r["concurrency"]) for r in rows}
    assert ("prompts.jsonl", 1.0, 2) in cells and ("more.jsonl", 0.0, 1) in cells
    assert {("prompts.jsonl@ctx40", t, 1) for t in (0.0, 1.0)} <= cells
    assert not any(r["name"].startswith("hf-") for r in rows if "@ctx" in r["dataset"])
    assert not any(r["name"] == "hf-prompt-lookup" and r["concurrency"] == 2 for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- held-out prompts and context padding ----


def test_committed_heldout_prompts_are_real_function_heads_from_the_sources():
    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines()]
    sources = read_sources(HELDOUT_SOURCES)
    assert len(rows) == 64
    for r in rows:
        lines = r["prompt"].splitlines(keepends=True)
        assert 10 <= len(lines) <= 30
        assert lines[0].lstrip().startswith(("def ", "class ", "async def "))
        src = sources[r["path"]].splitlines(keepends=True)
        assert src[r["line"] - 1 : r["line"] - 1 + len(lines)] == lines
        assert len(src) >= r["line"] - 1 + len(lines) + 4  # a held-out continuation follows


def test_build_heldout_is_deterministic(tmp_path):
    body = "".join(f"    y = x + {i}\n" for i in range(20))
    files = [
        {"path": f"stdlib/m{j}.py", "text": f"import os\n\n\ndef f{j}(x):\n{body}    return y\n\n\nclass C{j}:\n{body}"}
        for j in range(3)
    ]
    files.append({"path": "stdlib/encodings/cp0.py", "text": f"def table(x):\n{body}"})
    corpus = tmp_path / "test.jsonl"
    corpus.write_text("".join(json.dumps(f) + "\n" for f in files))
    a = build_heldout(corpus, tmp_path / "a", num_prompts=5)
    b = build_heldout(corpus, tmp_path / "b", num_prompts=5)
    assert a.prompts_path.read_bytes() == b.prompts_path.read_bytes()
    rows = [json.loads(line) for line in a.prompts_path.read_text().splitlines()]
    assert len(rows) == 5 and not any("encodings" in r["path"] for r in rows)
    assert all(10 <= r["prompt"].count("\n") <= 30 for r in rows)


def test_pad_to_depth_prepends_real_preceding_code_only():
    sources = {
        "a.py": "".join(f"a{i} = {i}\n" for i in range(200)),
        "b.py": "".join(f"b{i} = {i}\n" for i in range(50)) + "def g():\n    return SECRET\n",
    }
    prompt = BenchPrompt("def g():\n", "b.py", 51)
    for depth in (30, 200, 900):
        text = pad_to_depth(prompt, depth, len, sources)
        assert text.endswith(prompt.text) and "SECRET" not in text
        assert depth - 10 <= len(text) <= depth  # whole lines of at most 10 characters
        assert text[: -len(prompt.text)].endswith("b49 = 49\n")  # its own file's preceding lines come last
    everything = pad_to_depth(prompt, 10**6, len, sources)
    assert everything.startswith("a0 = 0\n")
    assert pad_to_depth(BenchPrompt("x" * 50), 20, len, sources) == "x" * 50


# ---- vLLM worker protocol ----

FAKE_VLLM = """
import json
import os
import sys
from types import SimpleNamespace as NS

import profile  # the standard library's, unless the worker's folder (dspark/bench) heads sys.path


def _log(**record):
    if os.environ.get("FAKE_VLLM_LOG"):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps(record) + "\\n")


class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw

class LLM:
    def __init__(self, **kw):
        self.spec = kw.get("speculative_config")
        self.drafts = 0
        _log(event="init", pid=os.getpid(), sys_path=sys.path, profile=profile.__file__,
             kv_space=os.environ.get("VLLM_CPU_KVCACHE_SPACE"), kw=kw)

    def generate(self, prompts, sp, use_tqdm=False):
        _log(event="generate", pid=os.getpid(), prompts=prompts)
        self.drafts += len(prompts)
        n = sp.kw["max_tokens"]
        return [NS(outputs=[NS(token_ids=list(range(n)))]) for _ in prompts]

    def get_metrics(self):
        if not self.spec:
            return []
        return [
            NS(name="vllm:spec_decode_num_drafts", value=self.drafts),
            NS(name="vllm:spec_decode_num_draft_tokens", value=4 * self.drafts),
            NS(name="vllm:spec_decode_num_accepted_tokens", value=2 * self.drafts),
            NS(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[self.drafts, self.drafts, 0, 0]),
        ]
"""


def _fake_vllm(root):
    (root / "vllm").mkdir()
    (root / "vllm" / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    return root


def _fake_log(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_vllm_worker_protocol_with_a_fake_vllm(tmp_path):
    from dspark.bench.baselines import VLLMMethod

    _fake_vllm(tmp_path)
    env = {"PYTHONPATH": str(tmp_path)}
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    m = VLLMMethod("vllm-ngram", sys.executable, tmp_path, spec, "float32", env=env)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6)
        first = m.run([[0, 5, 6], [0, 7]], params)
        second = m.run([[0, 5]], params)
    finally:
        m.close()
    assert first.output_tokens == 12 and second.output_tokens == 6
    assert second.counters == SpecCounters(1, 4, 2, (1, 1, 0, 0), 5, 0)  # a delta, not the running total
    assert second.counters.acceptance_length == 3.0
    plain = VLLMMethod("vllm", sys.executable, tmp_path, None, "float32", env=env)
    try:
        assert plain.run([[0, 5]], params).counters is None
    finally:
        plain.close()


def test_vllm_worker_is_isolated_gets_a_kv_space_and_our_exact_prompt_ids(tmp_path, monkeypatch):
    """The worker must not see dspark/bench on sys.path (our profile.py would shadow the standard library's), must
    start with VLLM_CPU_KVCACHE_SPACE set, and must hand vLLM exactly our token ids."""
    import profile

    import dspark.bench
    from dspark.bench.baselines import VLLMMethod

    _fake_vllm(tmp_path)
    log = tmp_path / "fake.jsonl"
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    env = {"PYTHONPATH": str(tmp_path), "FAKE_VLLM_LOG": str(log)}
    prompts = [[0, 11, 12, 13], [0, 5]]
    m = VLLMMethod("vllm", sys.executable, tmp_path, None, "float32", env=env)
    try:
        m.run(prompts, SamplingParams(temperature=0.0, max_tokens=3))
    finally:
        m.close()
    init, gen = _fake_log(log)
    bench_dir = Path(dspark.bench.__file__).resolve().parent
    assert all(Path(p or ".").resolve() != bench_dir for p in init["sys_path"])
    assert Path(init["profile"]).resolve() == Path(profile.__file__).resolve()
    assert init["kv_space"] == "1" and init["kw"]["skip_tokenizer_init"] is True
    assert gen["prompts"] == [{"prompt_token_ids": p} for p in prompts]
    assert not Path(m.log.name).exists()  # a clean exit leaves no log file behind
    m = VLLMMethod("vllm", sys.executable, tmp_path, None, "float32", env=env, kv_space_gib=3)
    m.close()
    assert _fake_log(log)[-1]["kv_space"] == "3"


def test_baselines_add_to_ar_and_dspark_and_vllm_brings_both_ngrams(tmp_path):
    from dspark.bench.speed import BenchConfig, Resolved, method_names

    res = Resolved(tmp_path, tmp_path / "draft", tmp_path / "draft", True, False)
    notes: list[str] = []
    assert method_names(BenchConfig("d.jsonl", baselines=("ngram",)), res, notes) == ["ar", "dspark", "ngram"]
    assert method_names(BenchConfig("d.jsonl", baselines=("dspark", "ar")), res, notes) == ["ar", "dspark"]
    with_vllm = BenchConfig("d.jsonl", baselines=("dflash",), vllm_python="python")
    assert method_names(with_vllm, res, notes) == ["ar", "dspark", "dflash", "ngram", "vllm", "vllm-ngram"]
    no_draft = Resolved(tmp_path, None, None, False, False)
    assert method_names(BenchConfig("d.jsonl", baselines=("ngram",)), no_draft, notes) == ["ar", "ngram"]
    assert any(n.startswith("dspark: skipped") for n in notes)


def test_bench_runs_each_vllm_method_alone_after_our_engines(tmp_path, monkeypatch, capsys):
    """--baselines ngram --vllm-python: rows ar, dspark, ngram, vllm-ngram (next to ours), vllm; every vLLM worker
    starts when no engine of ours is alive and no other vLLM worker runs."""
    import gc

    import dspark.bench.speed as speed
    from dspark.bench.baselines import VLLMMethod
    from dspark.cli import main

    live: list[VLLMMethod] = []
    starts: list[tuple[int, int]] = []  # (our live engines, live vLLM workers) when a vLLM worker starts

    class Watched(VLLMMethod):
        def __init__(self, *args, **kw):
            gc.collect()
            starts.append((sum(type(o) is Engine for o in gc.get_objects()), len(live)))
            super().__init__(*args, **kw)
            live.append(self)

        def close(self):
            super().close()
            live.remove(self)

    monkeypatch.setattr(speed, "VLLMMethod", Watched)
    _fake_vllm(tmp_path)
    log = tmp_path / "fake.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    target_dir, draft_dir = write_tiny_pair(tmp_path / "pair")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def f(x):\n", "x = 1\n")))
    out = tmp_path / "bench.json"
    argv = ["bench", "--dataset", str(data), "--model", str(target_dir), "--draft", str(draft_dir)]
    argv += ["--num-prompts", "2", "--max-tokens", "4", "--baselines", "ngram", "--vllm-python", sys.executable]
    argv += ["--dtype", "float32", "--ignore-eos", "--quiet", "--output", str(out), "--num-speculative-tokens", "3"]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["name"] for r in rows] == ["ar", "dspark", "ngram", "vllm-ngram", "vllm"]
    assert starts == [(0, 0), (0, 0)]
    assert all(r["output_tokens"] == 8 for r in rows)
    assert rows[3]["acceptance_length"] == 3.0 and rows[4]["acceptance_length"] is None
    assert "| vllm-ngram |" in capsys.readouterr().out
    inits = [e for e in _fake_log(log) if e["event"] == "init"]
    assert [e["kw"].get("speculative_config") is not None for e in inits] == [False, True]
    assert inits[1]["kw"]["speculative_config"]["num_speculative_tokens"] == 3


def test_a_failing_vllm_worker_costs_its_rows_not_the_run(tmp_path, capsys):
    from dspark.cli import main

    target_dir, draft_dir = write_tiny_pair(tmp_path / "pair")
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "def f(x):\n"}) + "\n")
    out = tmp_path / "bench.json"
    argv = ["bench", "--dataset", str(data), "--model", str(target_dir), "--draft", str(draft_dir), "--quiet"]
    argv += ["--num-prompts", "1", "--max-tokens", "3", "--baselines", "ngram", "--vllm-python", "/bin/false"]
    argv += ["--dtype", "float32", "--output", str(out), "--no-warmup"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["results"]] == ["ar", "dspark", "ngram"]
    assert sum("failed, no rows" in n for n in report["config"]["notes"]) == 2  # vllm and vllm-ngram


def test_peers_that_cannot_run_a_k3_hybrid_are_skipped_with_a_note(tmp_path):
    from dspark.bench.speed import BenchConfig, Resolved, method_names
    from dspark.models.tiny import write_tiny_hybrid_pair

    target, draft = write_tiny_hybrid_pair(tmp_path)
    res = Resolved(target, draft, draft, True, False)
    notes: list[str] = []
    names = method_names(BenchConfig("d.jsonl", vllm_python="python"), res, notes)
    assert "vllm" not in names and "hf-generate" not in names and "ngram" in names
    assert any("vllm" in n and "skipped" in n for n in notes) and any("hf-generate" in n for n in notes)


def test_default_baselines_include_the_guard_serve_runs():
    """Without --baselines the bench compares every applicable method, the guarded DSpark that `serve` runs by
    default among them."""
    from dspark.bench.speed import BenchConfig, Resolved, method_names
    from dspark.checkpoint.resolve import BUNDLED_DIR

    res = Resolved(BUNDLED_DIR / "k3-mini", BUNDLED_DIR / "k3-mini-dspark", BUNDLED_DIR / "k3-mini-dflash", True, False)
    names = method_names(BenchConfig("d.jsonl"), res, [])
    assert names[:2] == ["ar", "dspark"] and {"dflash", "dspark-guard", "ngram"} <= set(names)
