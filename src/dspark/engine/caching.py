"""The engine's side of prefix caching: caching committed blocks, state snapshots, and restoring them on a hit.

The pages hold everything a hit needs for the target (MLA latents, GQA keys and values) and for the drafter (its
context rows are extra layers of the same pages, or a second pool indexed by the same page ids): the drafter keeps no
other per-request state, since a proposal reads its context rows from the pages and embeds the anchor token. So a hit
skips exactly the rows already in the pages, and the uncached tail (at least one token) computes the rest, the last
row's logits included. A stateful target (KDA) also needs the recurrent state at the hit's end: ``StateSnapshots``
keeps it at cached block boundaries, taken from a prefill chunk that ends on one, or from a verification's state after
each row as decoding crosses one.
"""

from __future__ import annotations

from collections.abc import Sequence

from dspark.cache.allocator import BlockManager
from dspark.cache.prefix import PrefixCache
from dspark.cache.state import StateSnapshots
from dspark.engine.metrics import PrefixCacheStats
from dspark.engine.request import Request
from dspark.engine.runner import ModelRunner
from dspark.engine.scheduler import PrefillChunk


class PrefixCaching:
    """Called by the engine at admission, after each prefill and after each verification's commit."""

    def __init__(self, cache: PrefixCache, blocks: BlockManager, runner: ModelRunner, snapshots: int | None) -> None:
        """``snapshots``: how many state snapshots a stateful target keeps (ignored without recurrent state)."""
        self.cache = cache
        self.blocks = blocks
        self.runner = runner
        self.snapshots = None
        if runner.states is not None:
            capacity = snapshots if snapshots is not None else runner.states.num_slots
            self.snapshots = StateSnapshots(runner.states, capacity)
            cache.usable = self.snapshots.__contains__  # a stateful target hits only as far as a snapshot reaches
            cache.on_evict.append(self.snapshots.drop)  # its page is gone: no hit can end there any more

    def admitted(self, reqs: Sequence[Request], stats: PrefixCacheStats) -> None:
        """Count each admission's lookup; a stateful target's hit restores the state at its end."""
        P = self.cache.page_size
        for req in reqs:
            stats.record(req.num_tokens, req.num_cached_tokens, req.num_preemptions > 0)
            if self.snapshots is not None and req.num_cached_tokens:
                self.snapshots.restore(req.block_hashes[req.num_cached_tokens // P - 1], req.request_id)

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
        return rep | (self.snapshots.report() if self.snapshots is not None else {})
