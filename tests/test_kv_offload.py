"""KV offload: the block record (checksum, layout, salt), the CPU and disk tiers (LRU by bytes, atomic files, a tier
that cannot write), and the engine: greedy output unchanged on MLA, GQA and hybrid targets with and without
speculation when cached blocks are evicted to the CPU tier, the disk tier or both and loaded back; corrupt and
truncated blocks dropped and recomputed; flags, counters and the report."""

import dataclasses
import logging
import os
import shutil

import pytest
import torch

import dspark.cache.offload as offload
from dspark.cache.offload import BlockCodec, CorruptBlock, CpuTier, DiskTier, OffloadStats, OffloadStore, TensorSpec
from dspark.config import CacheConfig, ConfigError
from dspark.llm import LLM
from dspark.sampling_params import SamplingParams
from test_prefix_cache import P, engine, record_drafts, tokens

ROWS = [TensorSpec("pool0", torch.bfloat16, (3, P, 8)), TensorSpec("pool1", torch.float32, (2, P, 2))]
STATE = TensorSpec("state", torch.float32, (2, 5))


def payload(seed, state=False):
    g = torch.Generator().manual_seed(seed)
    specs = ROWS + ([STATE] if state else [])
    return {s.name: torch.randn(s.shape, generator=g).to(s.dtype) for s in specs}


def block(i):
    return bytes([i]) * 32


# ---- the record -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("state", [False, True])
def test_a_record_reads_back_exactly(state):
    codec = BlockCodec(b"salt", ROWS, STATE)
    tensors = payload(1, state)
    record = codec.encode(block(1), tensors)
    back = codec.decode(block(1), record)
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert all(back[k].dtype == tensors[k].dtype for k in tensors)


def test_a_record_with_an_odd_row_count_reads_back():  # the state after it starts off its 4-byte alignment
    rows, state = [TensorSpec("pool0", torch.bfloat16, (1, 1, 3))], TensorSpec("state", torch.float32, (2, 3))
    codec = BlockCodec(b"s", rows, state)
    tensors = {"pool0": torch.randn(1, 1, 3).bfloat16(), "state": torch.ones(2, 3)}
    back = codec.decode(block(1), codec.encode(block(1), tensors))
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_every_damage_is_detected():
    codec = BlockCodec(b"salt", ROWS, STATE)
    record = codec.encode(block(1), payload(1))
    flipped = bytearray(record)
    flipped[-3] ^= 0x40
    cases = {
        "checksum mismatch": bytes(flipped),
        "truncated: ": record[:-10],
        "truncated header": record[: len(offload.MAGIC) + 6],
        "bad magic": b"X" + record[1:],
        "names block": record,  # read as another block's record
    }
    for want, bad in cases.items():
        with pytest.raises(CorruptBlock, match=want):
            codec.decode(block(2) if want == "names block" else block(1), bad)
    with pytest.raises(CorruptBlock, match="salt differs"):
        BlockCodec(b"another model", ROWS, STATE).decode(block(1), record)
    with pytest.raises(CorruptBlock, match="not this engine's layout"):
        BlockCodec(b"salt", [TensorSpec("pool0", torch.bfloat16, (3, P, 9))]).decode(block(1), record)
    with pytest.raises(ValueError, match="the layout says"):
        codec.encode(block(1), {"pool0": torch.zeros(3, P, 8), "pool1": torch.zeros(2, P, 2)})  # pool0 not bf16


# ---- the tiers ----------------------------------------------------------------------------------------------------


def test_cpu_tier_is_lru_by_bytes(caplog):
    stats = OffloadStats()
    tier = CpuTier(250, stats)
    assert tier.put(block(1), b"a" * 100, False) == [] and tier.put(block(2), b"b" * 100, False) == []
    assert tier.get(block(1)) == b"a" * 100  # block 1 is now the most recently used
    assert tier.put(block(3), b"c" * 100, True) == [(block(2), b"b" * 100, False)]  # the LRU one moves out
    assert list(tier.index) == [block(1), block(3)] and tier.bytes == 200 and stats.evictions["cpu"] == 1
    assert tier.holds(block(3), True) and tier.holds(block(1), False) and not tier.holds(block(1), True)
    with caplog.at_level(logging.WARNING, "dspark.kv_offload"):
        assert tier.put(block(4), b"d" * 300, False) == [(block(4), b"d" * 300, False)]  # never fits: passes on
    assert "does not fit the cpu tier's budget (250 bytes)" in caplog.text and "kv_offload_cpu_bytes" in caplog.text
    assert len(tier) == 2 and stats.stores["cpu"] == 3


def test_disk_tier_writes_atomically_and_deletes_lru_files(tmp_path, monkeypatch):
    stats = OffloadStats()
    tier = DiskTier(tmp_path, 250, stats)
    assert tier.writable and tier.dir.parent == tmp_path and tier.dir.name.startswith(f"dspark-kv-{os.getpid()}-")
    replaced = []
    real_replace = os.replace

    def watched(src, dst):  # the final name appears only complete: written under a temporary name first
        replaced.append((open(src, "rb").read(), os.path.exists(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(offload.os, "replace", watched)
    for i in (1, 2, 3):
        assert tier.put(block(i), bytes([i]) * 100, False)
    assert replaced == [(bytes([i]) * 100, False) for i in (1, 2, 3)]
    assert not tier.path(block(1)).exists() and stats.evictions["disk"] == 1  # the least recently used file went
    assert sorted(p.name for p in tier.dir.iterdir()) == sorted(tier.path(block(i)).name for i in (2, 3))
    assert tier.get(block(2)) == bytes([2]) * 100 and list(tier.index) == [block(3), block(2)] and tier.bytes == 200

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(offload.os, "replace", full_disk)
    assert not tier.put(block(4), b"x" * 100, False)
    assert not tier.writable and stats.write_errors == 1 and not tier.put(block(5), b"y", False)
    assert sorted(p.name for p in tier.dir.iterdir()) == sorted(tier.path(block(i)).name for i in (2, 3))  # no tmp
    assert tier.get(block(3)) == bytes([3]) * 100  # what it holds still reads


def test_disk_tier_under_an_unusable_path_and_orphans(tmp_path, caplog):
    (tmp_path / "file").write_text("not a directory")
    with caplog.at_level(logging.WARNING, "dspark.kv_offload"):
        tier = DiskTier(tmp_path / "file" / "kv", 1 << 20, OffloadStats())
    assert not tier.writable and "cannot create a directory under" in caplog.text
    orphan, mine = tmp_path / "dspark-kv-999999999-abc", tmp_path / f"dspark-kv-{os.getpid()}-abc"
    for d in (orphan, mine):
        d.mkdir()
        (d / "x.kvb").write_bytes(b"old")
    tier = DiskTier(tmp_path, 1 << 20, OffloadStats())
    assert not orphan.exists() and mine.exists()  # a dead process's directory is removed, a live one's kept
    path = tier.dir
    del tier
    assert not path.exists()  # an engine's disk tier removes its directory when it goes


def test_the_store_spills_cpu_to_disk_and_drops_corrupt_copies(tmp_path, caplog):
    codec = BlockCodec(b"salt", ROWS, STATE)
    size = len(codec.encode(block(0), payload(0)))
    store = OffloadStore(codec, 2 * size, tmp_path, 1 << 20)
    calls = []

    def make(i):
        return lambda: calls.append(i) or payload(i)

    for i in (1, 2, 3):
        store.store(block(i), make(i), False)
    assert list(store.cpu.index) == [block(2), block(3)] and list(store.disk.index) == [block(1)]
    store.store(block(2), make(2), False)  # stored already: no copy out of the pool
    assert calls == [1, 2, 3]
    for i, tier in ((1, "disk"), (2, "cpu"), (3, "cpu")):
        tensors, where = store.load(block(i))
        assert where == tier and torch.equal(tensors["pool0"], payload(i)["pool0"])
    path = store.disk.path(block(1))
    path.write_bytes(path.read_bytes()[:-1])
    with caplog.at_level(logging.WARNING, "dspark.kv_offload"):
        assert store.load(block(1)) is None
    assert f"block {block(1).hex()[:16]} in the disk tier ({path}) is corrupt: truncated" in caplog.text
    assert not path.exists() and block(1) not in store and store.stats.corrupt_drops == {"cpu": 0, "disk": 1}
    store.store(block(4), lambda: payload(4, state=True), True)  # a stateful hit needs the state with it
    assert store.has_state(block(4)) and not store.has_state(block(3))
    assert store.load(block(4))[0]["state"].shape == STATE.shape


# ---- the engine -------------------------------------------------------------------------------------------------

A, B = tokens(20, 24), tokens(21, 36)  # on 12 pages, B's prefill evicts A's tail blocks and A's rerun evicts B's
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
REFS: dict = {}


def record_size(eng, state=False):
    codec = eng.prefix.offload.store.codec
    return len(codec.encode(block(0), {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in codec.layout(state)}))


def offload_engine(family, spec, tier, tmp_path, **cache):
    kw = {"cpu": {"kv_offload_cpu_bytes": 1 << 20}, "disk": {"kv_offload_dir": str(tmp_path)}}.get(tier)
    kw = kw or {"kv_offload_cpu_bytes": 1 << 20, "kv_offload_dir": str(tmp_path)}
    eng = engine(family, spec, num_pages=12, **(kw | cache))
    if tier == "cpu+disk":  # room for two and a half stateless blocks: the rest spills to disk
        eng.prefix.offload.store.cpu.budget = record_size(eng) * 5 // 2
    return eng


def run(eng, prompts=(A, B, A, B)):
    llm = LLM.from_engine(eng)
    outs = [llm.generate([p], PARAMS)[0] for p in prompts]
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]


def reference(family, spec):
    if (family, spec) not in REFS:
        eng = engine(family, spec, caching=False)
        drafts = record_drafts(eng) if spec else None
        REFS[family, spec] = run(eng)[0], drafts
    return REFS[family, spec]


@pytest.mark.parametrize("tier", ["cpu", "disk", "cpu+disk"])
@pytest.mark.parametrize("spec", [False, True], ids=["no-spec", "dspark"])
@pytest.mark.parametrize("family", ["mla", "gqa", "gqa-2pools", "hybrid"])
def test_greedy_output_is_unchanged_by_offload(family, spec, tier, tmp_path):
    """Blocks evicted from a 12-page pool come back from the tier(s) on the next hit: the same tokens, and with
    speculation the same drafts at every anchor (the drafter's rows come back with the target's)."""
    ref, ref_drafts = reference(family, spec)
    eng = offload_engine(family, spec, tier, tmp_path)
    drafts = record_drafts(eng) if spec else None
    got, cached = run(eng)
    assert got == ref and drafts == ref_drafts
    s = eng.prefix.offload.stats
    loads = {t: n for t, n in s.loads.items() if n}
    assert set(loads) == ({"cpu", "disk"} if tier == "cpu+disk" else {tier}), s
    assert cached[2:] == [20, 32]  # every prompt block but the last, some in the pool, the rest loaded back
    pc = eng.metrics.prefix_cache
    assert s.hits == sum(loads.values()) * P and pc.hits + s.hits == sum(cached) and s.queries == pc.queries
    assert s.corrupt_drops == {"cpu": 0, "disk": 0} and not eng.prefix.offload.failed
    assert eng.num_pages_free == 12 and all(eng.blocks.allocator.refcount(p) == 0 for p in range(12))
    rep = eng.cache_report()
    assert rep["kv_offload_hit_tokens"] == s.hits and rep[f"kv_offload_loads_{tier.split('+')[-1]}"] > 0
    if family == "hybrid":
        assert rep["kv_offload_state_bytes_per_block"] == eng.states.bytes_per_request
        assert len(eng.states.free) == eng.states.num_slots


def a_chain(eng):
    return eng.prefix.cache.extend([], A, 6)


@pytest.mark.parametrize("damage", ["flip", "truncate", "cpu-flip"])
@pytest.mark.parametrize("family", ["mla", "hybrid"])
def test_a_corrupt_block_is_dropped_and_recomputed(family, damage, tmp_path, caplog):
    ref, _ = reference(family, False)
    eng = offload_engine(family, False, "cpu" if damage == "cpu-flip" else "disk", tmp_path)
    llm = LLM.from_engine(eng)
    assert [llm.generate([p], PARAMS)[0].token_ids for p in (A, B)] == ref[:2]
    store, bad = eng.prefix.offload.store, a_chain(eng)[2]  # A's first evicted block: the next hit's first load
    if damage == "cpu-flip":
        record = bytearray(store.cpu.records[bad])
        record[-1] ^= 1
        store.cpu.records[bad] = bytes(record)
    else:
        path = store.disk.path(bad)
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data) if damage == "flip" else data[: len(data) // 2])
    with caplog.at_level(logging.WARNING, "dspark.kv_offload"):
        again = llm.generate([A], PARAMS)[0]
    # the pool's 2 blocks (a hybrid lacks a state there: none), the rest recomputed
    assert again.token_ids == ref[2] and again.num_cached_tokens == (0 if family == "hybrid" else 2 * P)
    tier = "cpu" if damage == "cpu-flip" else "disk"
    why = "truncated" if damage == "truncate" else "checksum mismatch"
    assert f"in the {tier} tier" in caplog.text and f"is corrupt: {why}" in caplog.text and "; dropped" in caplog.text
    assert store.stats.corrupt_drops[tier] == 1 and bad not in store and eng.cache_report()["kv_offload_corrupt_drops"]
    if tier == "disk":
        assert not store.disk.path(bad).exists()
    assert llm.generate([B], PARAMS)[0].token_ids == ref[3]


def test_a_full_tier_evicts_least_recently_used_blocks(tmp_path):
    ref, _ = reference("mla", False)
    eng = offload_engine("mla", False, "disk", tmp_path)
    size = record_size(eng)
    eng.prefix.offload.store.disk.budget = 2 * size
    got, cached = run(eng)
    disk, s = eng.prefix.offload.store.disk, eng.prefix.offload.stats
    assert got == ref and s.evictions["disk"] > 0 and len(disk) == 2 and disk.bytes <= 2 * size
    assert sorted(p.name for p in disk.dir.iterdir()) == sorted(disk.path(b).name for b in disk.index)
    # A's tail blocks were evicted 5, 4, 3, 2: the tier kept the newest two, so A's rerun loads 2 and 3, not 4
    assert s.loads["disk"] >= 2 and cached[2] == 4 * P
    eng = offload_engine("mla", False, "cpu", tmp_path)
    eng.prefix.offload.store.cpu.budget = 2 * size
    got, _ = run(eng)
    assert got == ref and eng.prefix.offload.stats.evictions["cpu"] > 0 and len(eng.prefix.offload.store.cpu) <= 2


@pytest.mark.parametrize("how", ["under-a-file", "broken-later", "budget-0"])
def test_a_tier_that_cannot_write_degrades(how, tmp_path, caplog):
    ref, _ = reference("mla", False)
    (tmp_path / "file").write_text("")
    where = tmp_path / "file" / "kv" if how == "under-a-file" else tmp_path
    with caplog.at_level(logging.WARNING, "dspark.kv_offload"):
        budget = 0 if how == "budget-0" else 1 << 20
        eng = engine("mla", num_pages=12, kv_offload_dir=str(where), kv_offload_disk_bytes=budget)
        disk = eng.prefix.offload.store.disk
        if how == "broken-later":
            shutil.rmtree(disk.dir)
            disk.dir.write_text("")  # the directory is gone: every write fails
        got, cached = run(eng)
    assert got == ref and cached[2] == 2 * P and not eng.prefix.offload.failed
    s = eng.prefix.offload.stats
    assert sum(s.stores.values()) == 0 and sum(s.loads.values()) == 0
    want = {"under-a-file": "cannot create a directory", "broken-later": "cannot write", "budget-0": "does not fit"}
    assert want[how] in caplog.text and s.write_errors == (0 if how == "budget-0" else 1)
    text = "\n".join(_report_lines(eng))
    assert ("no tier can store blocks" if how == "budget-0" else "disk (no longer writable) 0 blocks") in text


def test_an_unexpected_error_turns_offload_off_not_the_engine(tmp_path, caplog, monkeypatch):
    ref, _ = reference("mla", False)
    eng = offload_engine("mla", False, "cpu", tmp_path)

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(eng.prefix.offload.store, "load", boom)
    with caplog.at_level(logging.ERROR, "dspark.kv_offload"):
        got, _ = run(eng)
    assert got == ref and eng.prefix.offload.failed and "offload is off for this engine" in caplog.text
    assert eng.cache_report()["kv_offload_failed"] is True


# ---- config, flags, counters, report ------------------------------------------------------------------------------


def test_config_keys_are_checked():
    c = CacheConfig()
    assert (c.kv_offload_cpu_bytes, c.kv_offload_dir, c.kv_offload) == (0, None, False)  # off by default
    with pytest.raises(ConfigError, match="'kv_offload_cpu_bytes' = 1024 is invalid: KV offload .* set enable_prefix"):
        CacheConfig(kv_offload_cpu_bytes=1024)
    with pytest.raises(ConfigError, match="'kv_offload_dir' = '/tmp/x' is invalid: .*--enable-prefix-caching"):
        CacheConfig(kv_offload_dir="/tmp/x")
    for key, bad in (("kv_offload_cpu_bytes", -1), ("kv_offload_disk_bytes", 1.5), ("kv_offload_cpu_bytes", True)):
        with pytest.raises(ConfigError, match=f"'{key}' = {bad!r} is invalid: must be an integer number of bytes"):
            CacheConfig(enable_prefix_caching=True, **{key: bad})
    with pytest.raises(ConfigError, match="'kv_offload_dir' = ' ' is invalid"):
        CacheConfig(enable_prefix_caching=True, kv_offload_dir=" ")
    assert engine("mla", kv_offload_cpu_bytes=0).prefix.offload is None
    assert engine("mla").cache_report()["kv_offload"] is False


def test_the_flags_reach_the_engine_from_llm_and_every_cli(tmp_path, monkeypatch):
    import dspark.llm
    from dspark.cli import build_parser
    from dspark.models.tiny import write_tiny_pair

    target_dir, draft_dir = write_tiny_pair(tmp_path)
    spec = {"method": "dspark", "model": str(draft_dir)}
    kv = {"kv_offload_cpu_bytes": 1 << 20, "kv_offload_dir": str(tmp_path / "kv"), "kv_offload_disk_bytes": 1 << 22}
    llm = LLM(str(target_dir), spec, dtype="float32", enable_prefix_caching=True, **kv)
    store = llm.engine.prefix.offload.store
    assert (store.cpu.budget, store.disk.budget, store.disk.root) == (1 << 20, 1 << 22, tmp_path / "kv")

    seen = []

    def capture(*args, **kwargs):  # flat keywords (build_engine) or a CacheConfig (build_engines)
        cache = next((a for a in (*args, *kwargs.values()) if isinstance(a, CacheConfig)), None)
        given = {**(dataclasses.asdict(cache) if cache is not None else {}), **kwargs}
        seen.append({k: v for k, v in given.items() if k.startswith("kv_offload")})
        raise SystemExit(0)

    monkeypatch.setattr(dspark.llm, "build_engines", capture)
    monkeypatch.setattr(dspark.llm, "build_engine", capture)
    parser = build_parser()
    offload = ["--kv-offload-cpu-gib", "0.5", "--kv-offload-dir", "/kv", "--kv-offload-disk-gib", "2"]
    flags = [*offload, "--enable-prefix-caching"]  # offload keeps what the prefix cache evicts: the config asks both
    want = {"kv_offload_cpu_bytes": 1 << 29, "kv_offload_dir": "/kv", "kv_offload_disk_bytes": 1 << 31}
    default = dict(kv_offload_cpu_bytes=0, kv_offload_dir=None, kv_offload_disk_bytes=CacheConfig.kv_offload_disk_bytes)
    model = ["--model", str(target_dir)]
    lossless = ["verify-lossless", *model, "--dataset", "x.jsonl"]
    for argv in (["generate", *model], ["serve", str(target_dir)], lossless):
        for extra, expect in (([], default), (flags, want)):
            args = parser.parse_args(argv + extra)
            with pytest.raises(SystemExit):
                args.func(args)
            assert seen.pop() == expect, (argv, extra)
    args = parser.parse_args(["generate", *model, "--kv-offload-cpu-gib", "-1"])
    with pytest.raises(ConfigError, match="--kv-offload-cpu-gib -1.0 is invalid: give a size in GiB >= 0"):
        args.func(args)


def test_prometheus_counters(tmp_path):
    from dspark.serve.metrics import ServerMetrics

    eng = offload_engine("mla", False, "cpu+disk", tmp_path)
    run(eng)
    s = eng.prefix.offload.stats
    text = ServerMetrics(eng, "tiny").render().decode()
    for tier in ("cpu", "disk"):
        assert f'dspark:kv_offload_stores_total{{model_name="tiny",tier="{tier}"}} {float(s.stores[tier])}' in text
        assert f'dspark:kv_offload_loads_total{{model_name="tiny",tier="{tier}"}} {float(s.loads[tier])}' in text
    assert s.loads["disk"] > 0 and 'dspark:kv_offload_corrupt_drops_total{model_name="tiny",tier="disk"} 0.0' in text
    assert f'vllm:external_prefix_cache_hits_total{{model_name="tiny"}} {float(s.hits)}' in text and s.hits > 0
    assert f'vllm:external_prefix_cache_queries_total{{model_name="tiny"}} {float(s.queries)}' in text
    off = ServerMetrics(engine("mla", caching=False), "tiny").render().decode()
    assert 'dspark:kv_offload_loads_total{model_name="tiny",tier="cpu"} 0.0' in off


def _report_lines(eng):
    from dspark.cli import cache_report_lines

    return cache_report_lines(eng.cache_report())


@pytest.mark.parametrize("family", ["mla", "gqa", "hybrid"])
def test_cache_report_lines_and_bytes_per_token(family, tmp_path):
    eng = offload_engine(family, True, "cpu+disk", tmp_path)
    run(eng, (A, B, A))
    rep, text = eng.cache_report(), "\n".join(_report_lines(eng))
    assert f"KV offload in {rep['kv_offload_disk_dir']}: CPU {rep['kv_offload_cpu_blocks']} blocks" in text
    assert f"loaded back {rep['kv_offload_loads_disk']}" in text and "corrupt blocks dropped" in text
    moved = rep["kv_offload_bytes_per_token"]
    assert moved == rep["target_bytes_per_token"] + rep["draft_bytes_per_token"]  # every pool layer's row
    assert record_size(eng) - moved * P < 1024  # a stateless record: the rows of its P tokens + a header
    if family == "gqa":
        assert rep["kv_offload_per_head_bytes_per_token"] == moved and "the same layout" in text
        return
    mla, tfmt, dfmt = eng.target.config.mla, eng.target.page_format, eng.drafter.page_format
    per_head = tfmt.num_layers * mla.num_heads * (mla.qk_head_dim + mla.v_head_dim)  # values per token
    per_head += dfmt.num_layers * eng.drafter.separate_cache_width
    assert rep["kv_offload_per_head_bytes_per_token"] == per_head * 4 > moved  # fp32 engines
    assert f"per-head K/V would be {per_head * 4}" in text
    if family == "hybrid":
        assert "of recurrent state per block with a snapshot" in text


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_the_disk_tier_goes_with_a_server_that_is_stopped(sig, tmp_path):
    """A real `dspark serve` process with a disk tier, stopped by a signal as a supervisor stops it: its tier
    directory is gone once the process has exited (uvicorn re-raises the signal after its shutdown, so only an
    explicit close at shutdown removes it)."""
    import signal
    import subprocess
    import sys

    from dspark.models.tiny import write_tiny_pair
    from test_pd_disagg import free_port, wait_up

    target, _ = write_tiny_pair(tmp_path / "pair", seed=0)
    kv, port = tmp_path / "kv", free_port()
    cmd = [sys.executable, "-m", "dspark.cli", "serve", str(target), "--no-spec", "--dtype", "float32"]
    cmd += ["--port", str(port), "--log-level", "warning", "--enable-prefix-caching", "--kv-offload-dir", str(kv)]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=os.environ | {"DSPARK_NUM_THREADS": "1"}, stdout=out, stderr=out)
    try:
        wait_up(proc, log, f"http://127.0.0.1:{port}")
        assert list(kv.glob(f"{offload.DIR_PREFIX}*")), log.read_text()
        proc.send_signal(getattr(signal, sig))
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not list(kv.glob(f"{offload.DIR_PREFIX}*")), log.read_text()


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_a_hybrid_prefix_loads_back_when_snapshots_are_few(tier, tmp_path):
    """A stateful target keeps few state snapshots (as many as it has request slots, by default): one the capacity
    pushes out is stored with its block right then, so blocks evicted later still come back with their state and a
    hit can end there. Outputs are unchanged."""
    ref, _ = reference("hybrid", False)
    eng = offload_engine("hybrid", False, tier, tmp_path, max_state_snapshots=1)
    got, cached = run(eng)
    assert got == ref
    s = eng.prefix.offload.stats
    assert s.loads[tier] > 0 and s.hits > 0 and cached[2] > 0, (s, cached)
