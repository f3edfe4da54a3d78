"""Continuous-batching scheduler: decode first, then chunked prefill under a token budget; preempt-and-recompute
when the page pool runs out. With prefix caching, an admitted request first takes the pages of its longest cached
prefix and prefills only the rest. Pure Python (no torch)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dspark.cache.allocator import BlockManager
from dspark.cache.prefix import PrefixCache
from dspark.engine.request import Request, Status


@dataclass(frozen=True)
class PrefillChunk:
    request: Request
    start: int
    end: int  # exclusive; target positions start..end-1 are computed this step


@dataclass(frozen=True)
class SchedulerOutput:
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # waiting before this step (num_cached_tokens: their hit)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """``lookahead`` = tokens a decode step may write past num_computed (K + 1 with speculation, 1 without);
    ``prefix``: the prefix cache admissions look up (None: off)."""

    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        lookahead: int,
        prefix: PrefixCache | None = None,
    ) -> None:
        self.blocks = blocks
        self.prefix = prefix
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.lookahead = lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, req: Request, keep_pages: bool = False) -> None:
        """Forget a finished or aborted request and return its pages (``keep_pages``: kept for an export)."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req.request_id in self.blocks and not keep_pages:
            self.blocks.release(req.request_id)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.blocks.release(victim.request_id)
        victim.num_computed = 0
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def _reserve_decode(self, req: Request, out: SchedulerOutput) -> bool:
        """Grow req's table to hold its decode lookahead, preempting the youngest requests if needed."""
        need = req.num_computed + self.lookahead
        while not self.blocks.ensure_capacity(req.request_id, need):
            victim = max(self.running, key=lambda r: r.arrival)
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.budget
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req in self.running and not req.in_prefill and self._reserve_decode(req, out):
                out.decodes.append(req)
                budget -= self.lookahead
        # prefill: running requests mid-prefill first, then admit waiting ones (FIFO)
        candidates = [r for r in self.running if r.in_prefill] + list(self.waiting)
        for req in candidates:
            if budget <= 0:
                break
            admitting = req.status is Status.WAITING
            if admitting and len(self.running) >= self.max_num_seqs:
                break
            if admitting:
                self._take_cached_prefix(req)
            start = req.num_computed
            end = min(req.prefill_target, start + budget, *(s for s in req.split_at if s > start))
            if not self.blocks.ensure_capacity(
                req.request_id, end + (self.lookahead if end == req.prefill_target else 0)
            ) and not self.blocks.ensure_capacity(req.request_id, end):
                if admitting and req.request_id in self.blocks:  # give the hit back; looked up again next time
                    self.blocks.release(req.request_id)
                    req.num_computed = 0
                break  # wait for pages to free up
            if admitting:
                self.waiting.remove(req)
                req.status = Status.RUNNING
                self.running.append(req)
                out.admitted.append(req)
            out.prefills.append(PrefillChunk(req, start, end))
            budget -= end - start
        if out.empty and self.running:
            # every running request is stuck waiting for pages: recompute the youngest later
            self._preempt(max(self.running, key=lambda r: r.arrival), out)
            again = self.schedule()
            again.preempted[:0] = out.preempted
            return again
        return out

    def _take_cached_prefix(self, req: Request) -> None:
        """Start a waiting request's table with the pages of its longest cached prefix of full blocks, leaving at
        least one token to compute (the logits of the next token come from it).

        A stateful target (the cache's ``usable`` set: a hit needs a state snapshot) ends prefill chunks where a
        state is worth a snapshot: at the end of the cached run when the hit stops short of it (other requests
        share that prefix: the next one hits), and at the prompt's last full block (a repeated prompt hits)."""
        req.num_cached_tokens, req.split_at = 0, ()
        if self.prefix is None or req.params.prompt_logprobs is not None:  # every prompt row's logits are needed
            return
        P = self.blocks.page_size
        limit = (req.prefill_target - 1) // P
        chain = self.prefix.extend(req.block_hashes, req.all_ids, limit)[:limit]
        match = self.prefix.match(chain)
        hit = len(match.pages)
        if hit:
            self.blocks.share_prefix(req.request_id, match.pages)
        req.num_computed = req.num_cached_tokens = hit * P
        if self.prefix.usable is not None:
            req.split_at = tuple(sorted(n * P for n in {match.cached_blocks, limit} if n > hit))
