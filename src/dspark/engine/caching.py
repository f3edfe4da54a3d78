"""The engine's side of prefix caching: caching committed blocks, state snapshots, and restoring them on a hit.

The pages hold everything a hit needs for the target (MLA latents, GQA keys and values) and for the drafter (its
context rows are extra layers of the same pages, or a second pool indexed by the same page ids): the drafter keeps no
other per-request state, since a proposal reads its context rows from the pages and embeds the anchor token. So a hit
skips exactly the rows already in the pages, and the uncached tail (at least one token) computes the rest, the last
row's logits included. A stateful target (KDA) also needs the recurrent state at the hit's end: ``StateSnapshots``
keeps it at cached block boundaries, taken from a prefill chunk that ends on one, or from a verification's state after
each row as decoding crosses one.

With KV offload (``Offloading``), a block the pool evicts is copied out first (its rows in every pool layer, and its
state snapshot) to the CPU tier, then disk (``cache/offload.py``); an admission's lookup that runs out of cached
pages brings the next blocks it finds there back into fresh pages, caches them again (and their snapshots), and
counts them as a hit, all inside the scheduler's admission, before the prefill forward that reads them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from dspark.cache.allocator import BlockManager
from dspark.cache.offload import BlockCodec, OffloadStats, OffloadStore, TensorSpec, layout_bytes
from dspark.cache.prefix import PrefixCache
from dspark.cache.state import StateSnapshots
from dspark.config import CacheConfig
from dspark.engine.metrics import PrefixCacheStats
from dspark.engine.request import Request
from dspark.engine.runner import ModelRunner
from dspark.engine.scheduler import PrefillChunk

logger = logging.getLogger("dspark.kv_offload")


class PrefixCaching:
    """Called by the engine at admission, after each prefill and after each verification's commit."""

    def __init__(self, cache: PrefixCache, blocks: BlockManager, runner: ModelRunner, config: CacheConfig) -> None:
        """``config.max_state_snapshots``: how many state snapshots a stateful target keeps (ignored without
        recurrent state); ``config.kv_offload_*``: the offload tiers (none by default)."""
        self.cache = cache
        self.blocks = blocks
        self.runner = runner
        self.snapshots = None
        # first: an evicted page is copied out (with its snapshot) before the snapshot is dropped below
        self.offload = Offloading(cache, runner, config) if config.kv_offload else None
        if runner.states is not None:
            snapshots = config.max_state_snapshots
            capacity = snapshots if snapshots is not None else runner.states.num_slots
            self.snapshots = StateSnapshots(runner.states, capacity)
            cache.usable = self.snapshots.__contains__  # a stateful target hits only as far as a snapshot reaches
            cache.on_evict.append(self.snapshots.drop)  # its page is gone: no hit can end there any more
            if self.offload is not None:
                self.offload.snapshots = self.snapshots
                self.snapshots.on_capacity_drop = self.offload.spill

    def close(self) -> None:
        """Release what outlives the requests: the offload tiers (the disk tier's directory is removed)."""
        if self.offload is not None:
            self.offload.store.close()

    @property
    def offload_stats(self) -> OffloadStats | None:
        return self.offload.stats if self.offload is not None else None

    def admitted(self, reqs: Sequence[Request], stats: PrefixCacheStats) -> None:
        """Count each admission's lookup (tokens from blocks loaded back from the offload tiers apart, as vLLM
        counts external hits); a stateful target's hit restores the state at its end."""
        P = self.cache.page_size
        for req in reqs:
            loaded = self.offload.hit_blocks(req) * P if self.offload is not None else 0
            stats.record(req.num_tokens, req.num_cached_tokens - loaded, req.num_preemptions > 0)
            if self.snapshots is not None and req.num_cached_tokens:
                self.snapshots.restore(req.block_hashes[req.num_cached_tokens // P - 1], req.request_id)
        if self.offload is not None:
            self.offload.loaded.clear()

    def prefilled(self, chunks: Sequence[PrefillChunk]) -> None:
        """After a prefill: cache the blocks it completed; a chunk ending on a block boundary snapshots the state
        (the scheduler ends a stateful target's chunks at the boundaries worth it)."""
        for b, c in enumerate(chunks):
            self._cache(c.request, (), c.start, b, per_row=False)

    def committed(self, req: Request, accepted: Sequence[int], start: int, b: int) -> None:
        """After a verification of batch row ``b`` committed rows ``start..num_computed−1`` (the anchor and the
        ``accepted`` drafts, not yet appended): cache the blocks it completed; crossing a block boundary, the state
        there (the verification kept the state after every row) replaces the request's previous decode snapshot, so
        a finished request leaves the one a next turn extending its prompt and output needs."""
        self._cache(req, accepted, start, b, per_row=True)

    def _cache(self, req: Request, pending: Sequence[int], start: int, b: int, per_row: bool) -> None:
        """Rows ``start..num_computed−1`` are final (``pending``: tokens among them not yet appended)."""
        P, end = self.cache.page_size, req.num_computed
        first, last = start // P, end // P
        if last <= first:  # most decode steps: no block completed
            return
        chain = self.cache.extend(req.block_hashes, [*req.all_ids, *pending], last)
        self.runner.flush_context([req.request_id])  # the drafter's rows of a cached block are final
        self.cache.register(chain, self.blocks.table(req.request_id).pages, first, last)
        block = chain[last - 1]  # the last block completed: a snapshot holds the state after its last row
        if self.snapshots is None or block not in self.cache or not (per_row or last * P == end):
            return
        if per_row and req.decode_snapshot is not None:  # decoding keeps one snapshot per request: its latest
            self.snapshots.drop(req.decode_snapshot)
            req.decode_snapshot = None
        row = last * P - 1 - start if per_row else None
        if self.snapshots.save(block, self.runner.state_after(b, row)) and per_row:
            req.decode_snapshot = block

    def report(self, stats: PrefixCacheStats) -> dict[str, int | float | bool]:
        rep: dict[str, int | float | bool] = {"prefix_caching": True} | self.cache.report()
        rep |= {"prefix_cache_queries": stats.queries, "prefix_cache_hits": stats.hits}
        rep["prefix_cache_hit_rate"] = stats.hit_rate
        rep |= self.offload.report() if self.offload is not None else {"kv_offload": False}
        return rep | (self.snapshots.report() if self.snapshots is not None else {})


class Offloading:
    """The engine's side of KV offload: evicted pages out to the tiers, a lookup's next blocks back into pages."""

    def __init__(self, cache: PrefixCache, runner: ModelRunner, config: CacheConfig) -> None:
        self.cache = cache
        self.runner = runner
        self.snapshots: StateSnapshots | None = None  # set by PrefixCaching for a stateful target
        pool, draft = runner.pool, runner.draft_pool
        self.pools = [pool] if draft is None or draft is pool else [pool, draft]
        P = cache.page_size
        rows = [TensorSpec(f"pool{i}", p.dtype, (p.num_layers, P, p.width)) for i, p in enumerate(self.pools)]
        states = runner.states
        state = TensorSpec("state", states.states.dtype, tuple(states.states[:, 0].shape)) if states else None
        self.store = OffloadStore(
            BlockCodec(cache.salt, rows, state),
            config.kv_offload_cpu_bytes,
            config.kv_offload_dir,
            config.kv_offload_disk_bytes,
        )
        self.stats = self.store.stats
        self.loaded: set[bytes] = set()  # blocks loaded back since the last admissions were counted
        self.failed = False  # an unexpected error: offload is off from then on (logged once)
        cache.on_evict.insert(0, self.evicted)
        cache.below = self.reload

    def evicted(self, block: bytes, page: int) -> None:
        """The allocator is about to reuse ``page``: copy its block out (never raises: offload just stops)."""
        if self.failed or not self.store.writable:
            return
        try:
            state = self.snapshots.peek(block) if self.snapshots is not None else None
            self.store.store(block, lambda: self._payload(page, state), state is not None)
        except Exception:  # noqa: BLE001 - the engine must keep serving; the block is simply recomputed later
            self._fail("storing an evicted block")

    def spill(self, block: bytes, state: torch.Tensor) -> None:
        """A snapshot the capacity pushes out while its block is still cached: store the block with that state now
        (at its page's eviction later the tiers already hold it), so a later hit can still end at this block."""
        if self.failed or not self.store.writable or block not in self.cache:
            return
        try:
            page = self.cache.page_of(block)
            self.store.store(block, lambda: self._payload(page, state), True)
        except Exception:  # noqa: BLE001 - the engine must keep serving; the block is simply recomputed later
            self._fail("storing a block with its state snapshot")

    def _payload(self, page: int, state: torch.Tensor | None) -> dict[str, torch.Tensor]:
        P = self.cache.page_size
        out = {f"pool{i}": p.pool[:, page * P : (page + 1) * P] for i, p in enumerate(self.pools)}
        return out | ({"state": state} if state is not None else {})

    def reload(self, chain: Sequence[bytes], run: int) -> int:
        """``PrefixCache.below``: load the blocks ``chain[run:]`` the tiers hold (as far as pages are free, and for a
        stateful target as far as a state comes with them) into fresh pages and cache them; returns how many."""
        if self.failed:
            return 0
        try:
            return self._reload(chain, run)
        except Exception:  # noqa: BLE001 - a failed load is a miss: the tokens are recomputed
            self._fail("loading offloaded blocks")
            return 0

    def _reload(self, chain: Sequence[bytes], run: int) -> int:
        alloc = self.cache.allocator
        pinned = [self.cache.page_of(b) for b in chain[:run]]
        alloc.share(pinned)  # the hit so far: its pages must not be evicted by the allocation below
        try:
            found: list[tuple[bytes, Mapping[str, torch.Tensor], str]] = []
            for block in chain[run : run + alloc.num_free()]:
                got = self.store.load(block) if block in self.store and block not in self.cache else None
                if got is None:
                    break
                found.append((block, *got))
            while found and self.snapshots is not None and "state" not in found[-1][1]:
                found.pop()  # a stateful target's hit must end where a state comes back with the block
            return self._install(chain, run, pinned, found) if found else 0
        finally:
            alloc.free(pinned)

    def _install(
        self, chain: Sequence[bytes], run: int, pinned: list[int], found: list[tuple[bytes, Mapping, str]]
    ) -> int:
        alloc, P = self.cache.allocator, self.cache.page_size
        pages = alloc.allocate(len(found))  # may evict other idle blocks (offloaded in turn)
        try:
            for page, (block, tensors, tier) in zip(pages, found):
                for i, p in enumerate(self.pools):
                    p.pool[:, page * P : (page + 1) * P].copy_(tensors[f"pool{i}"])
                if "state" in tensors and self.snapshots is not None:
                    self.snapshots.save(block, tensors["state"].to(self.snapshots.pool.states.device))
                self.stats.loads[tier] += 1
            self.cache.register(chain, [*pinned, *pages], run, run + len(pages))
            self.loaded.update(block for block, _, _ in found)
        finally:
            alloc.free(pages)  # idle cached pages now (before the hit's: evicted first), taken by the hit next
        return len(pages)

    def hit_blocks(self, req: Request) -> int:
        """How many blocks of ``req``'s hit were loaded back (and counts the lookup in tokens)."""
        n = sum(1 for h in req.block_hashes[: req.num_cached_tokens // self.cache.page_size] if h in self.loaded)
        self.stats.queries += req.num_tokens
        self.stats.hits += n * self.cache.page_size
        return n

    def _fail(self, what: str) -> None:
        self.failed = True
        logger.exception("kv offload: unexpected error while %s; offload is off for this engine from now on", what)

    def report(self) -> dict[str, int | str | bool]:
        rep = self.store.report() | {"kv_offload_failed": self.failed}
        dtype = self.runner.pool.dtype
        return rep | layout_bytes(self.runner.target, self.runner.drafter, dtype)
