"""Long context on tiny pairs with small windows: chunked prefill == one-shot prefill (logits and every cached
row, target and drafter layers), speculative greedy == target-only greedy on prompts longer than the original
YaRN window (with chunked prefill in the engine, and with a bounded draft window)."""

from dataclasses import replace

import pytest
import torch

from dspark.cache.allocator import BlockManager, PageAllocator
from dspark.cache.pool import CachePools
from dspark.config import EngineConfig, SpeculativeConfig
from dspark.config.runtime import DEFAULT_DRAFT_WINDOW
from dspark.engine.engine import Engine
from dspark.engine.request import Request
from dspark.engine.runner import ModelRunner
from dspark.llm import LLM
from dspark.models.tiny import build_tiny_gqa_pair, build_tiny_pair, tiny_draft_config, tiny_target_config
from dspark.sampling_params import SamplingParams
from dspark.speculative.propose import SamplingTensors
from dspark.speculative.rng import round_counters

ORIGINAL = 64  # the tiny pairs' original window; YaRN factor 8 stretches it to 512 positions


def long_pair(seed: int = 0):
    tcfg = tiny_target_config()
    tcfg = replace(tcfg, rope=replace(tcfg.rope, factor=8.0, original_max_position_embeddings=ORIGINAL))
    return build_tiny_pair(seed, tcfg, tiny_draft_config(tcfg))


def _runner(target, drafter, num_pages=64, page=8):
    fmt = drafter.page_format if drafter is not None else None
    pools = CachePools.build(target.page_format, fmt, num_pages, page, torch.float32)
    blocks = BlockManager(PageAllocator(num_pages, page))
    return ModelRunner(target, drafter, blocks, pools), blocks, pools


def _prefill(target, drafter, ids, chunk):
    """Prefill ids in chunks of ``chunk`` rows (scrambled pages); → (logits [T, V], pool rows [L, T, W] per pool)."""
    runner, blocks, pools = _runner(target, drafter)
    req = Request("a", ids, SamplingParams(), 0)
    blocks.ensure_capacity("decoy", 40)
    blocks.ensure_capacity("a", len(ids))
    blocks.release("decoy")
    logits = []
    for s in range(0, len(ids), chunk):
        logits.append(runner.target_forward([req], [s], [ids[s : s + chunk]], last_only=False)[0])
    slots = runner.context_slots([req], [len(ids)])[0]
    pool_list = [pools.target] if pools.draft is None or pools.shared else [pools.target, pools.draft]
    return torch.cat(logits), [p.pool[:, slots] for p in pool_list]


@pytest.mark.parametrize("family", ["mla", "llama"])
def test_chunked_prefill_equals_one_shot(family):
    """A 200-token prompt (3× the original window) prefilled in chunks of 48 equals one pass: logits at every
    row and the latent/KV rows of every target and drafter layer (the drafter's context injection included)."""
    target, drafter = long_pair(0) if family == "mla" else build_tiny_gqa_pair(0)
    ids = torch.randint(4, 96, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    one_logits, one_pages = _prefill(target, drafter, ids, len(ids))
    chunk_logits, chunk_pages = _prefill(target, drafter, ids, 48)
    torch.testing.assert_close(chunk_logits, one_logits, rtol=1e-5, atol=1e-5)
    assert len(one_pages) == len(chunk_pages)
    assert one_pages[0].shape[0] == target.page_format.num_layers + len(drafter.layers)
    for a, b in zip(chunk_pages, one_pages):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        ref = target(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(one_logits, ref, rtol=1e-4, atol=1e-4)


def _generate(target, drafter, spec, prompts, params, ecfg):
    eng = Engine(target, drafter, spec, ecfg)
    return [o.token_ids for o in LLM.from_engine(eng).generate(prompts, params)], eng


def long_prompts(seed: int, n: int, lo: int = ORIGINAL + 10, hi: int = 4 * ORIGINAL):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(4, 96, (ln,), generator=g).tolist() for ln in lengths]


@pytest.mark.parametrize("draft_window", [0, 16])
def test_speculative_greedy_beyond_the_original_window(draft_window):
    """Prompts of 74..255 tokens on a pair whose YaRN window is 64 (factor 8), prefilled in chunks of 40 tokens:
    speculative greedy (DSpark and DFlash, 5 drafts) is token for token target-only greedy; a bounded draft
    window changes only what the drafter sees, never the output."""
    target, drafter = long_pair(1)
    prompts = long_prompts(3, 4)
    params = [SamplingParams(temperature=0, max_tokens=24 + 4 * i) for i in range(len(prompts))]
    ecfg = EngineConfig(dtype="float32", max_num_seqs=4, max_num_batched_tokens=40)
    ref, _ = _generate(target, None, None, prompts, params, ecfg)
    for method, rule, draw in [("dspark", "block", "probabilistic"), ("dflash", "standard", "greedy")]:
        spec = SpeculativeConfig(
            method=method,
            num_speculative_tokens=5,
            rejection_sample_method=rule,
            draft_sample_method=draw,
            draft_window=draft_window,
        )
        got, eng = _generate(target, drafter, spec, prompts, params, ecfg)
        assert got == ref, (method, draft_window)
        assert eng.metrics.spec.num_drafts > 0


def _draft(target, drafter, ids_list, window, corrupt_before=None):
    """Prefill requests and propose one greedy drafter block each; optionally overwrite every cached drafter row
    at positions < corrupt_before[b] with noise first. → drafted tokens [B, K], hidden-state proxy (confidence)."""
    runner, blocks, pools = _runner(target, drafter)
    runner.draft_window = window
    reqs = [Request(f"r{i}", ids, SamplingParams(), 0) for i, ids in enumerate(ids_list)]
    for r in reqs:
        blocks.ensure_capacity(r.request_id, len(r.all_ids) + 8)
        runner.target_forward([r], [0], [r.all_ids[:-1]], last_only=True)
        r.num_computed = len(r.all_ids) - 1
    if corrupt_before is not None:
        g = torch.Generator().manual_seed(0)
        for r, end in zip(reqs, corrupt_before):
            slots = runner.context_slots([r], [end])[0]
            layers = slice(pools.draft_layer_offset, None)
            noise = torch.randn(pools.draft.pool[layers, slots].shape, generator=g)
            pools.draft.pool[layers, slots] = noise
    B = len(reqs)
    sampling = SamplingTensors(
        temperature=torch.zeros(B),
        top_k=torch.zeros(B, dtype=torch.long),
        top_p=torch.ones(B),
        seeds=torch.zeros(B, dtype=torch.long),
        counters=round_counters(torch.tensor([r.num_computed for r in reqs]), 6),
    )
    p = runner.propose_draft(reqs, sampling, probabilistic=False, use_markov=True, topk=None)
    return p.tokens, p.confidence


def test_draft_window_reads_only_the_last_w_context_rows():
    """With draft_window W the drafter's proposal does not depend on cached rows older than the last W (they are
    overwritten with noise and nothing changes), it does without a window, and W >= the context is no window."""
    target, drafter = long_pair(2)
    ids = long_prompts(4, 3, lo=30, hi=120)
    W = 12
    tok, conf = _draft(target, drafter, ids, W)
    old = [max(0, len(x) - 1 - W) for x in ids]  # positions before each request's window
    tok_c, conf_c = _draft(target, drafter, ids, W, corrupt_before=old)
    assert torch.equal(tok, tok_c)
    torch.testing.assert_close(conf, conf_c, rtol=0, atol=0)
    _, conf_full_c = _draft(target, drafter, ids, None, corrupt_before=old)
    _, conf_full = _draft(target, drafter, ids, None)
    assert not torch.allclose(conf_full, conf_full_c)  # the unwindowed drafter reads those rows
    _, conf_big = _draft(target, drafter, ids, 10_000)
    torch.testing.assert_close(conf_big, conf_full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"draft_window": -1}, "draft_window"),
        ({"draft_window": 2.5}, "draft_window"),
        ({"draft_window": True}, "draft_window"),
        ({"method": "ngram", "draft_window": 64}, "n-gram has none"),
    ],
)
def test_draft_window_is_validated(cfg, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(cfg)
    assert SpeculativeConfig.from_dict({"draft_window": 256}).draft_window_rows == 256
    assert SpeculativeConfig.from_dict({}).draft_window_rows == DEFAULT_DRAFT_WINDOW  # the default window
    assert SpeculativeConfig.from_dict({"draft_window": 0}).draft_window_rows is None  # the whole context


@pytest.mark.parametrize("family", ["mla", "llama-separate-pool"])
def test_cache_report_for_a_16k_request_matches_the_pool_tensors(family):
    """The bytes cache_report gives for a 16,384-token request are the bytes of that request's pages in the real
    pool tensors (target layers, drafter layers); the separate-cache figure is per-head K and V of every drafter
    layer (the MLA drafter's kv_b_proj output plus the rope key per head)."""
    from dspark.cli import cache_report_lines
    from dspark.config import CacheConfig
    from dspark.models.tiny import tiny_gqa_config, tiny_gqa_draft_config

    if family == "mla":
        target, drafter = long_pair(0)
    else:
        tcfg = tiny_gqa_config()
        target, drafter = build_tiny_gqa_pair(0, tcfg, tiny_gqa_draft_config(tcfg, share_pages=False))
    N, page = 16_384 + 5, 16
    eng = Engine(
        target,
        drafter,
        SpeculativeConfig(method="dspark"),
        EngineConfig(dtype="float32"),
        CacheConfig(page_size=page, num_pages=N // page + 4),
    )
    rep = eng.cache_report(N)
    eng.blocks.ensure_capacity("long", N)
    pages = torch.tensor(eng.blocks.table("long").pages)
    assert rep["request_pages"] == len(pages) == N // page + 1

    def held(pool, layers):  # bytes of the request's pages in these layers of the real tensor
        t = pool.pool.view(pool.num_layers, -1, page, pool.width)[layers][:, pages]
        return t.numel() * t.element_size()

    Lt = target.page_format.num_layers
    assert rep["request_target_bytes"] == held(eng.pools.target, slice(0, Lt))
    off = eng.pools.draft_layer_offset
    assert rep["request_draft_bytes"] == held(eng.pools.draft, slice(off, off + len(drafter.layers)))
    attn = drafter.layers[0].self_attn
    if family == "mla":
        per_head_kv = attn.kv_b_proj.out_features + attn.cfg.num_heads * attn.cfg.qk_rope_head_dim
    else:
        per_head_kv = attn.k_proj.out_features + attn.v_proj.out_features
    assert rep["request_separate_draft_bytes"] == len(pages) * page * len(drafter.layers) * per_head_kv * 4
    text = "\n".join(cache_report_lines(rep))
    word = "latents" if family == "mla" else "K/V rows"  # the family's terms
    assert f"a {N}-token request: target {word}" in text
    # the comparison with a separate per-head draft cache only where it differs (a GQA drafter is one already)
    assert ("less)" in text) == (rep["request_separate_draft_bytes"] != rep["request_draft_bytes"])


def test_verify_lossless_at_context_depths(tmp_path, capsys):
    """`dspark verify-lossless --context-depths` pads each prompt with real preceding code (the bench's padding) to
    each depth and compares target-only with speculative output token by token; the target's whole window is padded
    to leave room for the new tokens, a deeper depth is skipped with a message naming max_model_len, and only
    skipped depths is an error."""
    import json
    import re

    from dspark.cli import main
    from dspark.models.tiny import write_tiny_pair

    target_dir, draft_dir = write_tiny_pair(tmp_path)
    code = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(40))
    sources = tmp_path / "sources.jsonl"
    sources.write_text(json.dumps({"path": "a.py", "text": code}) + "\n" + json.dumps({"path": "b.py", "text": code}))
    data = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "def f7(x):\n", "path": "a.py", "line": 22},
        {"prompt": "def g(y):\n", "path": "b.py", "line": 5},
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    spec = json.dumps({"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 3})
    argv = ["verify-lossless", "--dataset", str(data), "--model", str(target_dir), "--speculative-config", spec]
    argv += ["--context-source", str(sources), "--max-tokens", "10"]
    assert main([*argv, "--context-depths", "100,300,1024"]) == 0
    out = capsys.readouterr().out
    assert "depth 100: 2/2 prompts identical token by token" in out
    assert "depth 300: 2/2 prompts identical token by token" in out
    assert "context depth 1024: skipped" in out and "max_model_len 512" in out
    lengths = [int(n) for n in re.findall(r"depth 300 prompt \d: identical \((\d+) prompt tokens", out)]
    assert len(lengths) == 2 and all(300 - 40 < n <= 300 for n in lengths)  # padded to within a line of the depth
    assert main([*argv, "--context-depths", "512"]) == 0  # the whole window: room is left for the new tokens
    out = capsys.readouterr().out
    room = 512 - 10 - 3 - 1
    assert f"context depth 512: prompts padded to {room} tokens" in out and "depth 512: 2/2 prompts identical" in out
    lengths = [int(n) for n in re.findall(r"depth 512 prompt \d: identical \((\d+) prompt tokens", out)]
    assert len(lengths) == 2 and all(room - 40 < n <= room for n in lengths)
    assert main([*argv, "--context-depths", "2048"]) == 1
    assert "nothing was verified" in capsys.readouterr().err


def test_bench_draft_window_adds_a_windowed_dspark_row(tmp_path):
    """`dspark bench --draft-window W` measures 'dspark-window' next to dspark in the same interleaved run (τ and
    speed per cell, the window in the report's config); asking for the method without a window is an error."""
    import json

    from dspark.bench.speed import BenchConfig, run_bench
    from dspark.config import ConfigError
    from dspark.models.tiny import write_tiny_pair

    target_dir, draft_dir = write_tiny_pair(tmp_path / "pair")
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "def f(x):\n"}) + "\n")
    cfg = BenchConfig(
        str(data),
        str(target_dir),
        str(draft_dir),
        num_prompts=1,
        max_tokens=6,
        baselines=("dspark",),
        num_speculative_tokens=3,
        context_depths=(120,),
        context_prompts=1,
        dtype="float32",
        draft_window=16,
        ignore_eos=True,
        progress=False,
        warmup=False,
    )
    report = run_bench(cfg)
    assert report.config["draft_window"] == 16
    rows = {(r.name, r.dataset) for r in report.results}
    assert {("dspark-window", "prompts.jsonl@ctx120"), ("dspark", "prompts.jsonl@ctx120")} <= rows
    assert all(r.acceptance_length is not None for r in report.results if r.name.startswith("dspark"))
    deep = [r for r in report.results if r.dataset.endswith("@ctx120")]
    assert all(r.decode_speedup_vs_ar is not None and r.decode_speedup_vs_ar > 0 for r in deep)
    from dspark.bench.plots import plot_report

    assert plot_report(report.to_json(), tmp_path / "bench.png").stat().st_size > 0  # τ and speed-up vs depth
    with pytest.raises(ConfigError, match="needs --draft-window"):
        BenchConfig(str(data), baselines=("dspark-window",))


def test_served_draft_distribution_equals_the_training_forward_at_depth():
    """Train/serve parity beyond the original window: for a request prefilled in chunks of 48 rows into scrambled
    pages, the drafter's served q (probabilistic drafting at T=1) equals softmax of the training forward
    (`BlockForward` over the target's offline features, Markov teacher-forced with the served drafts), and the
    confidence logits agree. Anything the serving path reads differently at depth (positions, chunk boundaries,
    page order, context injection) breaks this."""
    from dspark.train.anchors import block_inputs
    from dspark.train.draft_model import BlockForward
    from dspark.train.features import target_features

    target, drafter = long_pair(3)
    ids = torch.randint(4, 96, (230,), generator=torch.Generator().manual_seed(11)).tolist()
    taps = tuple(drafter.config.target_layer_ids)
    feats = target_features(target, torch.tensor([ids]), taps, "float32", autocast=False)
    fwd = BlockForward(drafter).eval()
    Kb = 5  # drafts per block (the tiny drafter has no trained block_size)
    for anchor in (70, 229):  # past the 64-position original window; the last anchor sees every chunk
        runner, blocks, _ = _runner(target, drafter)
        req = Request("a", ids[: anchor + 1], SamplingParams(), 0)
        blocks.ensure_capacity("decoy", 40)
        blocks.ensure_capacity("a", anchor + 1 + Kb)
        blocks.release("decoy")
        for s in range(0, anchor, 48):
            runner.target_forward([req], [s], [ids[s : min(s + 48, anchor)]], last_only=True)
        req.num_computed = anchor
        sampling = SamplingTensors(
            temperature=torch.ones(1),
            top_k=torch.zeros(1, dtype=torch.long),
            top_p=torch.ones(1),
            seeds=torch.tensor([7]),
            counters=round_counters(torch.tensor([anchor]), Kb + 1),
        )
        p = runner.propose_draft([req], sampling, probabilistic=True, use_markov=True, topk=None)
        anchors = torch.tensor([[anchor]])
        block = block_inputs(torch.tensor([ids]), anchors, Kb, drafter.config.mask_token_id)
        with torch.no_grad():
            logits, conf = fwd(block, anchors, torch.ones(1, 1, dtype=torch.bool), p.tokens[:, None], feats.taps)
        torch.testing.assert_close(p.q[0], torch.softmax(logits[0, 0], -1), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(p.confidence[0], conf[0, 0], rtol=1e-4, atol=1e-4)


def test_default_pool_holds_one_request_of_max_model_len():
    """With max_num_seqs=1 the default pool still takes a prompt + max_tokens of the whole context (speculation's
    lookahead included); a pool set too small names the pages needed and the key to raise."""
    target, drafter = long_pair(4)
    eng = Engine(target, drafter, SpeculativeConfig(method="dspark"), EngineConfig(dtype="float32", max_num_seqs=1))
    n = eng.max_model_len
    prompt = torch.randint(4, 96, (n - 8,), generator=torch.Generator().manual_seed(0)).tolist()
    out = LLM.from_engine(eng).generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].token_ids) == 8
    from dspark.config import CacheConfig
    from dspark.engine.engine import EngineError

    small = Engine(target, None, None, EngineConfig(dtype="float32"), CacheConfig(num_pages=4, page_size=16))
    with pytest.raises(EngineError, match="KV pages but the pool has 4; raise CacheConfig.num_pages"):
        small.add_request(prompt, SamplingParams(max_tokens=8))
