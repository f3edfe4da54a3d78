"""Automatic prefix caching: the hash chain, shared pages by reference count, LRU eviction, admission, the three
target families (MLA, GQA, hybrid KDA + MLA with state snapshots) with and without speculation, preemption while
pages are shared, and the vLLM counters."""

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.cache.allocator import BlockManager, PageAllocator, PoolExhausted
from dspark.cache.prefix import PrefixCache, block_hash
from dspark.config import CacheConfig, ConfigError, EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.engine.request import Request
from dspark.engine.scheduler import PrefillChunk, Scheduler
from dspark.llm import LLM
from dspark.models.tiny import (
    build_tiny_gqa_pair,
    build_tiny_hybrid_pair,
    build_tiny_pair,
    tiny_gqa_config,
    tiny_gqa_draft_config,
)
from dspark.sampling_params import SamplingParams
from test_hybrid_engine import _noisy_oracle

FP32 = EngineConfig(dtype="float32", max_num_seqs=8)
P = 4  # page size of every engine here: blocks of 4 tokens
BUILDERS = {
    "mla": build_tiny_pair,  # the drafter's MLA rows: extra layers of the target's pages
    "gqa": build_tiny_gqa_pair,  # the drafter's GQA rows in the target's pool
    "gqa-2pools": lambda seed: build_tiny_gqa_pair(  # a drafter with 1 KV head: a second pool, the same page ids
        seed, tiny_gqa_config(), tiny_gqa_draft_config(tiny_gqa_config(), share_pages=False)
    ),
    "hybrid": build_tiny_hybrid_pair,
}
PAIRS: dict = {}


def pair(family):
    if family not in PAIRS:
        PAIRS[family] = BUILDERS[family](0)
    return PAIRS[family]


def engine(family, spec=False, caching=True, **cache):
    target, drafter = pair(family)
    cfg = SpeculativeConfig(method="dspark", num_speculative_tokens=3, speculation_guard=False) if spec else None
    return Engine(target, drafter, cfg, FP32, CacheConfig(page_size=P, enable_prefix_caching=caching, **cache))


def tokens(seed, n):
    return torch.randint(4, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = tokens(0, 30)  # a shared system prompt: 7 full blocks and 2 tokens
USERS = [tokens(1, 5), tokens(2, 9), tokens(3, 2)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


# ---- pure Python: hash chain, allocator, prefix cache, admission ------------------------------------------


def test_policy_modules_import_no_torch():
    code = (
        "import sys, dspark.cache.prefix, dspark.cache.allocator, dspark.engine.scheduler, dspark.engine.metrics; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_hashes_chain_the_whole_prefix_and_the_salt():
    cache = PrefixCache(PageAllocator(8, P), "model-a")
    a = cache.extend([], list(range(12)), 3)
    b = cache.extend([], [99, *range(1, 12)], 3)
    assert len(set(a)) == 3 and all(x != y for x, y in zip(a, b))  # one token differs: every later block too
    assert cache.extend(a[:1], list(range(12)), 3) == a  # extending a chain = hashing it whole
    assert PrefixCache(PageAllocator(8, P), "model-b").extend([], list(range(12)), 3)[0] != a[0]
    assert block_hash(b"", [1, 2], b"s") == block_hash(b"", (1, 2), b"s") != block_hash(b"", [1, 3], b"s")
    with pytest.raises(ValueError, match="4 blocks of 4 tokens need 16 tokens, got 12"):
        cache.extend([], list(range(12)), 4)


def test_shared_pages_refcounts_and_lru_eviction_only_when_the_free_list_is_empty():
    alloc = PageAllocator(6, P)
    evicted: list[int] = []
    alloc.on_evict.append(evicted.append)
    blocks, cache = BlockManager(alloc), PrefixCache(alloc, "m")
    blocks.ensure_capacity("a", 16)
    blocks.set_length("a", 16)
    pa = list(blocks.table("a").pages)
    chain = cache.extend([], list(range(4, 20)), 4)
    cache.register(chain, pa, 0, 4)
    match = cache.match(chain[:3])  # b shares three blocks while a runs
    assert match.pages == pa[:3] and match.cached_blocks == 3
    blocks.share_prefix("b", match.pages)
    assert [alloc.refcount(p) for p in pa] == [2, 2, 2, 1] and blocks.table("b").num_tokens == 12
    blocks.release("a")  # a's pages keep their blocks: b holds three, the fourth is idle
    assert [alloc.refcount(p) for p in pa] == [1, 1, 1, 0] and alloc.num_idle_cached() == 1
    blocks.release("b")
    assert alloc.num_free() == 6 and alloc.num_idle_cached() == 4 and cache.num_cached_blocks == 4
    assert sorted(alloc.allocate(2)) == [4, 5] and evicted == []  # never-cached pages first
    # then the least recently freed: a's idle tail, then b's pages tail first (a prefix outlives its extensions)
    assert alloc.allocate(2) == [pa[3], pa[2]] and evicted == [pa[3], pa[2]]
    assert chain[3] not in cache and chain[2] not in cache and cache.match(chain).cached_blocks == 2
    blocks.share_prefix("c", cache.match(chain).pages)  # a hit takes idle pages back: no longer evictable
    assert alloc.num_idle_cached() == 0 and [alloc.refcount(p) for p in pa[:2]] == [1, 1]
    with pytest.raises(PoolExhausted):
        alloc.allocate(1)
    with pytest.raises(ValueError, match="already has a block table"):
        blocks.share_prefix("c", [])


def test_sharing_a_free_page_and_duplicate_blocks_and_usable_hits():
    alloc = PageAllocator(4, P)
    blocks, cache = BlockManager(alloc), PrefixCache(alloc, "m")
    with pytest.raises(ValueError, match="page 0 is free and holds no cached block"):
        alloc.share([0])
    with pytest.raises(ValueError, match="only a page in use can become cached"):
        alloc.mark_cached(0)
    chain = cache.extend([], list(range(8)), 2)
    for rid in ("a", "b"):  # two requests computed the same blocks: the first pages stay the cached ones
        blocks.ensure_capacity(rid, 8)
        cache.register(chain, blocks.table(rid).pages, 0, 2)
    assert cache.match(chain).pages == blocks.table("a").pages
    assert not any(alloc.is_cached(p) for p in blocks.table("b").pages)
    cache.usable = lambda block: block == chain[0]  # a stateful target: only block 0 has a snapshot
    match = cache.match(chain)
    assert match.pages == blocks.table("a").pages[:1] and match.cached_blocks == 2


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.lists(st.integers(0, 1), min_size=1, max_size=14), st.booleans()), min_size=1, max_size=12),
    st.integers(4, 9),
)
def test_a_hit_always_returns_pages_holding_the_requests_own_prefix(requests, num_pages):
    """Random admissions (prompts over two token ids, so prefixes collide) and releases on a small pool: every page
    a hit hands out holds exactly the request's tokens for those positions, and the page accounting adds up."""
    alloc = PageAllocator(num_pages, 2)
    blocks, cache = BlockManager(alloc), PrefixCache(alloc, "m")
    written: dict[int, tuple[int, ...]] = {}  # page -> the prefix whose last block its rows hold
    held: list[str] = []
    for n, (prompt, keep) in enumerate(requests):
        rid, chain = f"r{n}", cache.extend([], prompt, (len(prompt) - 1) // 2)
        match = cache.match(chain)
        for i, page in enumerate(match.pages):
            assert written[page] == tuple(prompt[: (i + 1) * 2])
        blocks.share_prefix(rid, match.pages)
        if not blocks.ensure_capacity(rid, len(prompt)):
            blocks.release(rid)
            continue
        pages = blocks.table(rid).pages
        for i in range(len(match.pages), len(pages)):  # the request computes the rest into its own pages
            assert alloc.refcount(pages[i]) == 1
            written[pages[i]] = tuple(prompt[: (i + 1) * 2])
        blocks.set_length(rid, len(prompt))
        cache.register(cache.extend(chain, prompt, len(prompt) // 2), pages, len(match.pages), len(prompt) // 2)
        held.append(rid)
        if not keep:
            blocks.release(held.pop(0))
        in_use = sum(alloc.refcount(p) > 0 for p in range(num_pages))
        assert alloc.num_free() == num_pages - in_use and alloc.num_idle_cached() <= cache.num_cached_blocks


def test_admission_takes_the_cached_prefix_leaving_a_token_and_splits_a_stateful_prefill():
    alloc = PageAllocator(16, P)
    blocks, cache = BlockManager(alloc), PrefixCache(alloc, "m")
    sched = Scheduler(blocks, 4, 64, 1, cache)
    prompt = list(range(4, 12))  # exactly two blocks
    a = Request("a", prompt, SamplingParams(max_tokens=4), 0)
    sched.add(a)
    out = sched.schedule()
    assert out.prefills == [PrefillChunk(a, 0, 8)] and out.admitted == [a] and a.num_cached_tokens == 0
    a.num_computed = 8
    blocks.set_length("a", 8)
    cache.register(cache.extend(a.block_hashes, a.all_ids, 2), blocks.table("a").pages, 0, 2)
    b = Request("b", prompt, SamplingParams(max_tokens=4), 0)  # the same prompt: its last block is recomputed
    sched.add(b)
    out = sched.schedule()
    assert out.prefills == [PrefillChunk(b, 4, 8)] and b.num_cached_tokens == 4 and b.split_at == ()
    shared = blocks.table("a").pages[0]
    assert blocks.table("b").pages[0] == shared and alloc.refcount(shared) == 2
    assert blocks.table("b").pages[1] != blocks.table("a").pages[1]  # b writes its own pages only
    cache.usable = lambda block: False  # stateful, no snapshots: no hit; chunks end where snapshots are worth it
    c = Request("c", [*prompt, *range(20, 25)], SamplingParams(max_tokens=4), 0)
    sched.add(c)
    out = sched.schedule()
    assert c.num_cached_tokens == 0 and c.split_at == (8, 12) and PrefillChunk(c, 0, 8) in out.prefills


def test_config_keys_are_checked():
    assert CacheConfig().enable_prefix_caching is False  # off by default: nothing changes unless asked for
    with pytest.raises(ConfigError, match="'enable_prefix_caching' = 'yes' is invalid: must be true or false"):
        CacheConfig(enable_prefix_caching="yes")
    with pytest.raises(ConfigError, match="'max_state_snapshots' = -1 is invalid"):
        CacheConfig(max_state_snapshots=-1)


# ---- the engine: greedy output unchanged, hits where expected ---------------------------------------------------


def conversation(eng):
    """Three requests sharing SYSTEM, one after the other, then a second turn extending each prompt + output:
    (tokens per request, cached tokens per request, the first turn's prompts)."""
    llm = LLM.from_engine(eng)
    prompts = [SYSTEM + u for u in USERS]
    first = [llm.generate([p], GREEDY)[0] for p in prompts]
    second = llm.generate([p + o.token_ids + [7, 8, 9] for p, o in zip(prompts, first)], GREEDY)
    return [o.token_ids for o in first + second], [o.num_cached_tokens for o in first + second], prompts


def record_drafts(eng):
    """The drafter's block at every anchor: {tokens up to and with the anchor: drafts} (filled as the engine runs)."""
    drafts, propose = {}, eng.runner.propose_draft

    def recorded(reqs, *args, **kwargs):
        proposal = propose(reqs, *args, **kwargs)
        for i, r in enumerate(reqs):
            drafts[tuple(r.all_ids[: r.num_computed + 1])] = proposal.tokens[i].tolist()
        return proposal

    eng.runner.propose_draft = recorded
    return drafts


@pytest.mark.parametrize("spec", [False, True], ids=["no-spec", "dspark"])
@pytest.mark.parametrize("family", ["mla", "gqa", "gqa-2pools", "hybrid"])
def test_greedy_output_is_unchanged_by_prefix_caching(family, spec):
    """The same tokens, and with speculation the same drafts at every anchor: the drafter reads the context rows a
    hit found in the pages as it reads rows it computed itself."""
    ref_eng, eng = engine(family, spec, caching=False), engine(family, spec)
    ref_drafts, drafts = record_drafts(ref_eng), record_drafts(eng)
    ref, ref_cached, prompts = conversation(ref_eng)
    got, cached, _ = conversation(eng)
    assert got == ref and ref_cached == [0] * 6 and drafts == ref_drafts
    system = len(SYSTEM) // P * P  # 28: the system prompt's full blocks
    # the second request finds SYSTEM's blocks; a hybrid lacks the state there and snapshots it for the third
    assert cached[:3] == ([0, 0, system] if family == "hybrid" else [0, system, system])
    for prompt, hit in zip(prompts, cached[3:]):  # a second turn: the first turn's prompt and output blocks
        assert hit >= (len(prompt) - 1) // P * P
    rep = eng.cache_report()
    assert rep["prefix_cache_hits"] == sum(cached) and rep["prefix_cached_blocks"] > 0
    assert eng.num_pages_free == eng.pool.num_pages and all(eng.blocks.allocator.refcount(p) == 0 for p in range(8))
    if spec:
        s = eng.metrics.spec  # one block per request step: each anchor once
        assert s.num_drafts > 0 and len(drafts) == s.num_drafts + s.num_undrafted
    if family == "hybrid":
        assert 0 < rep["state_snapshots"] <= rep["max_state_snapshots"] == FP32.max_num_seqs
        assert rep["state_snapshot_bytes"] == rep["state_snapshots"] * rep["state_bytes_per_request"]
        assert len(eng.states.free) == eng.states.num_slots


@pytest.mark.parametrize("family", ["mla", "hybrid"])
def test_rejected_draft_rows_are_never_cached(family):
    """Drafts spoiled at varying positions: every round writes rejected rows past the valid length. A second turn
    that hits the first turn's blocks would differ if any of them held a rejected row."""
    target, _ = pair(family)
    runs = []
    for caching in (False, True):
        eng = engine(family, spec=True, caching=caching)
        eng.runner.propose_draft = _noisy_oracle(target, 3)
        runs.append(conversation(eng))
        assert eng.metrics.spec.num_accepted_tokens < eng.metrics.spec.num_draft_tokens  # some were rejected
    assert runs[0][0] == runs[1][0] and sum(runs[1][1][3:]) > 0


@pytest.mark.parametrize("family", ["mla", "gqa", "hybrid"])
def test_a_request_hits_the_prefix_of_one_that_is_decoding(family):
    prompt_a = SYSTEM + USERS[0]
    prompt_b = prompt_a + [11, 12, 13]  # a branch of a's prompt: its full blocks (and, hybrid, a's snapshot)
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in LLM.from_engine(engine(family, True, caching=False)).generate([prompt_a], long)]
    ref += [o.token_ids for o in LLM.from_engine(engine(family, True, caching=False)).generate([prompt_b], GREEDY)]
    eng = engine(family, spec=True)
    a = eng.add_request(prompt_a, long)
    while len(a.output_ids) < 4:  # a is decoding speculatively
        eng.step()
    b = eng.add_request(prompt_b, GREEDY)
    eng.step()
    hit = (len(prompt_a) - 1) // P  # a's prompt blocks (a's prefill snapshotted the state after the last one)
    assert b.num_cached_tokens == hit * P and not a.finished
    pages_a, pages_b = eng.blocks.table(a.request_id).pages, eng.blocks.table(b.request_id).pages
    assert pages_b[:hit] == pages_a[:hit] and all(eng.blocks.allocator.refcount(p) == 2 for p in pages_a[:hit])
    assert not set(pages_b[hit:]) & set(pages_a)  # b's own rows land in its own pages
    while eng.has_unfinished:
        eng.step()
    assert [a.output_ids, b.output_ids] == ref
    assert eng.num_pages_free == eng.pool.num_pages


@pytest.mark.parametrize("spec", [False, True], ids=["no-spec", "dspark"])
@pytest.mark.parametrize("family", ["mla", "gqa", "hybrid"])
def test_preemption_while_pages_are_shared(family, spec):
    prompts = [SYSTEM[:16] + tokens(10 + i, 1 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in LLM.from_engine(engine(family, spec, caching=False)).generate(prompts, params)]
    eng = engine(family, spec, num_pages=16)
    shared_at_preemption, preempt = [], eng.scheduler._preempt

    def counted(victim, out):  # pages of the victim that other requests hold too
        pages = eng.blocks.table(victim.request_id).pages
        shared_at_preemption.append(sum(eng.blocks.allocator.refcount(p) > 1 for p in pages))
        preempt(victim, out)

    eng.scheduler._preempt = counted
    got = [o.token_ids for o in LLM.from_engine(eng).generate(prompts, params)]
    assert got == ref and max(shared_at_preemption) > 0
    pc = eng.metrics.prefix_cache
    assert eng.metrics.num_preemptions > 0 and pc.preempted_requests > 0 and pc.hits + pc.preempted_hits > 0
    alloc = eng.blocks.allocator
    assert alloc.num_free() == 16 and all(alloc.refcount(p) == 0 for p in range(16))
    assert eng.cache_report()["prefix_cached_blocks"] == alloc.num_idle_cached() > 0  # cached blocks stayed
    if family == "hybrid":
        assert len(eng.states.free) == eng.states.num_slots


def test_lru_eviction_under_a_tiny_pool():
    a_prompt, b_prompt = tokens(20, 24), tokens(21, 36)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = [o.token_ids for o in LLM.from_engine(engine("mla", caching=False)).generate([a_prompt], params)]
    eng = engine("mla", num_pages=12)
    llm = LLM.from_engine(eng)
    assert llm.generate([a_prompt], params)[0].token_ids == ref[0]
    alloc = eng.blocks.allocator
    assert alloc.num_idle_cached() == 6  # a's 27 rows: six full blocks stay cached, the partial seventh is free
    again = llm.generate([a_prompt], params)[0]
    assert again.num_cached_tokens == 20 and again.token_ids == ref[0]  # every block but the last of the prompt
    llm.generate([b_prompt], params)  # 10 pages: the 6 never-cached ones, then 4 evicted, a's tail blocks first
    assert alloc.num_free() == 12 and eng.cache_report()["prefix_cached_blocks"] == 2 + 9  # a's head + b's blocks
    third = llm.generate([a_prompt], params)[0]
    assert third.num_cached_tokens == 8 and third.token_ids == ref[0]  # a's first two blocks survived


def test_a_stateful_target_without_snapshots_never_hits():
    ref, _, _ = conversation(engine("hybrid", caching=False))
    eng = engine("hybrid", max_state_snapshots=0)
    got, cached, _ = conversation(eng)
    assert got == ref and cached == [0] * 6
    rep = eng.cache_report()
    assert rep["prefix_cached_blocks"] > 0 and rep["state_snapshots"] == 0 and rep["state_snapshot_bytes"] == 0


# ---- counters, reports, flags ---------------------------------------------------------------------------------


def test_vllm_prefix_cache_counters_in_tokens():
    from dspark.serve.metrics import ServerMetrics

    eng = engine("mla")
    llm = LLM.from_engine(eng)
    a = tokens(30, 18)
    llm.generate([a], GREEDY)
    out = llm.generate([a[:16] + tokens(31, 5)], GREEDY)[0]  # 21 tokens, the first 4 blocks shared
    assert out.num_cached_tokens == 16
    pc = eng.metrics.prefix_cache
    assert (pc.requests, pc.queries, pc.hits, pc.preempted_requests) == (2, 18 + 21, 16, 0)
    assert pc.hit_rate == pytest.approx(16 / 39)
    text = ServerMetrics(eng, "tiny").render().decode()
    assert 'vllm:prefix_cache_queries_total{model_name="tiny"} 39.0' in text
    assert 'vllm:prefix_cache_hits_total{model_name="tiny"} 16.0' in text
    off = ServerMetrics(engine("mla", caching=False), "tiny").render().decode()
    assert 'vllm:prefix_cache_queries_total{model_name="tiny"} 0.0' in off


def test_cache_report_lines():
    from dspark.cli import cache_report_lines

    eng = engine("hybrid")
    conversation(eng)
    rep = eng.cache_report(64)
    text = "\n".join(cache_report_lines(rep))
    assert f"prefix cache: {rep['prefix_cached_blocks']} blocks cached" in text
    assert f"hit rate {rep['prefix_cache_hit_rate']:.0%}" in text and "state snapshots:" in text
    assert "prefix cache" not in "\n".join(cache_report_lines(engine("mla", caching=False).cache_report()))


def test_the_flag_reaches_the_engine_from_llm_and_every_cli(tmp_path, monkeypatch):
    import dspark.bench.speed
    import dspark.llm
    from dspark.cli import build_parser
    from dspark.models.tiny import write_tiny_pair

    target_dir, draft_dir = write_tiny_pair(tmp_path)
    spec = {"method": "dspark", "model": str(draft_dir)}
    llm = LLM(str(target_dir), spec, dtype="float32", enable_prefix_caching=True, max_state_snapshots=2)
    assert llm.engine.prefix is not None and llm.engine.scheduler.prefix is not None
    assert LLM(str(target_dir), spec, dtype="float32").engine.prefix is None  # the default: off

    seen = []

    def capture(*args, **kwargs):  # flat keywords (build_engine), a CacheConfig (build_engines) or the bench config
        holder = next((a for a in (*args, *kwargs.values()) if isinstance(a, CacheConfig)), args[0])
        seen.append(kwargs.get("enable_prefix_caching", getattr(holder, "enable_prefix_caching", None)))
        raise SystemExit(0)

    monkeypatch.setattr(dspark.llm, "build_engines", capture)
    monkeypatch.setattr(dspark.llm, "build_engine", capture)
    monkeypatch.setattr(dspark.bench.speed, "run_bench", capture)
    parser = build_parser()
    for argv in (["generate", "--model", str(target_dir)], ["serve", str(target_dir)], ["bench"]):
        for flag, want in (([], False), (["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False)):
            args = parser.parse_args(argv + flag)
            with pytest.raises(SystemExit):
                args.func(args)
            assert seen.pop() is want, (argv, flag)
