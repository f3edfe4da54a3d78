"""Automatic prefix caching (vLLM's APC): full pages named by a chained hash of their tokens, shared on a hit.

Block i of a request is positions ``i·P .. (i+1)·P − 1``. Its hash is sha256(salt | hash of block i−1 | its token
ids), so equal hashes mean equal prefixes (the whole chain up to the block) in the same model and cache format (the
salt). A block is cached once it is full and committed (every row below the block table's valid length: rejected
draft rows past it never count). Admission looks up a request's longest run of cached blocks and shares their pages
by reference count; the request computes only the rest, into pages of its own, so a shared page is never written.
A cached page nobody uses stays on the allocator's idle list, content kept, until an allocation needs it (least
recently used first); then ``on_evict`` hooks hear of it (state snapshots drop theirs; the KV offload tier copies
the page out first). A lookup that runs out of cached pages asks ``below`` (the offload tier, when there is one) to
bring the next blocks back into pages cached here, and goes on. Pure Python (no torch).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dspark.cache.allocator import PageAllocator


def block_hash(parent: bytes, tokens: Sequence[int], salt: bytes) -> bytes:
    """The name of a full block: its parent's name (b"" for the first block), its token ids and the salt."""
    h = hashlib.sha256(salt)
    h.update(len(parent).to_bytes(1, "little") + parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass(frozen=True)
class PrefixMatch:
    pages: list[int]  # the hit: pages of the leading cached blocks a request may take, in position order
    cached_blocks: int  # leading blocks found cached (more than the hit when a stateful target lacks a snapshot)


class PrefixCache:
    """Block hash ↔ page for the pages of one allocator. ``usable``: a hit must end at a block it accepts (a stateful
    target: one with a state snapshot), else the hit shortens to the longest such prefix (possibly none)."""

    def __init__(self, allocator: PageAllocator, salt: str) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.salt = salt.encode()
        self._page: dict[bytes, int] = {}
        self._hash: dict[int, bytes] = {}
        self.usable: Callable[[bytes], bool] | None = None
        self.on_evict: list[Callable[[bytes, int], None]] = []  # (block hash, page) before the page is reused
        # a lower storage tier: (chain, run) → how many blocks chain[run:] it cached here again (0: none), where
        # chain[:run] are cached here (their pages must survive the allocations it makes)
        self.below: Callable[[Sequence[bytes], int], int] | None = None
        allocator.on_evict.append(self._evicted)

    def __contains__(self, block: bytes) -> bool:
        return block in self._page

    @property
    def num_cached_blocks(self) -> int:
        return len(self._page)

    def extend(self, chain: list[bytes], tokens: Sequence[int], num_blocks: int) -> list[bytes]:
        """Hash full blocks of ``tokens`` onto ``chain`` (a request's block hashes so far) until it names
        ``num_blocks`` blocks (tokens must cover them); returns ``chain``."""
        P = self.page_size
        if len(tokens) < num_blocks * P:
            raise ValueError(f"{num_blocks} blocks of {P} tokens need {num_blocks * P} tokens, got {len(tokens)}")
        for i in range(len(chain), num_blocks):
            chain.append(block_hash(chain[i - 1] if i else b"", tokens[i * P : (i + 1) * P], self.salt))
        return chain

    def page_of(self, block: bytes) -> int:
        return self._page[block]

    def match(self, chain: Sequence[bytes]) -> PrefixMatch:
        """The longest run of cached blocks at the start of ``chain`` (``below`` bringing back the blocks it holds
        past the pages' run), cut back to a ``usable`` end."""
        run = self._run(chain, 0)
        while self.below is not None and run < len(chain) and self.below(chain, run) > 0:
            run, before = self._run(chain, run), run
            if run == before:
                break
        hit = run
        while hit and self.usable is not None and not self.usable(chain[hit - 1]):
            hit -= 1
        return PrefixMatch([self._page[h] for h in chain[:hit]], run)

    def _run(self, chain: Sequence[bytes], run: int) -> int:
        while run < len(chain) and chain[run] in self._page:
            run += 1
        return run

    def register(self, chain: Sequence[bytes], pages: Sequence[int], first: int, end: int) -> None:
        """Cache blocks ``first..end−1`` of a block table (``pages``), named by ``chain``: their rows are final. A
        block already cached in another page (two requests computed it) keeps that page; this one stays private."""
        for i in range(first, end):
            block, page = chain[i], pages[i]
            if block in self._page or page in self._hash:
                continue
            self._page[block], self._hash[page] = page, block
            self.allocator.mark_cached(page)

    def _evicted(self, page: int) -> None:
        block = self._hash.pop(page)
        del self._page[block]
        for hook in self.on_evict:
            hook(block, page)

    def report(self) -> dict[str, int]:
        return {
            "prefix_cached_blocks": len(self._page),
            "prefix_idle_cached_blocks": self.allocator.num_idle_cached(),
        }
