"""Page allocator and per-request block tables for the paged latent KV cache (pure Python, no torch).

Target and drafter share one block table per request: the same page ids index the target's latent pool and
the drafter's pool (which may live in a different tensor with a different width or dtype). This module only
hands out page ids; the tensors live in `cache/pool.py`.

Rollback of rejected draft tokens is `set_length`: no copies, no frees. KV written beyond the length is
simply overwritten by the next step. Preemption is `release` followed by recompute later.

With prefix caching (`cache/prefix.py`) a page can hold a cached block: shared by reference count while requests
use it, and, once nobody does, kept with its content on a least-recently-used list that allocation takes from only
when the never-cached free pages run out (telling the `on_evict` hooks first).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field


class PoolExhausted(RuntimeError):
    """The page pool has fewer free pages than a request asked for."""


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class PageAllocator:
    """Free list plus reference counts over `num_pages` pages of `page_size` tokens each, and the cached pages
    nobody uses (least recently used first), reclaimed on demand."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        _check_positive("num_pages", num_pages)
        _check_positive("page_size", page_size)
        self.num_pages = num_pages
        self.page_size = page_size
        self._refcount = [0] * num_pages
        # Stack: pop() hands out the lowest ids first; freed pages are reused first (warm in cache), in the order
        # they were freed in, so a request's pages tend to form one run of consecutive slots (read in place).
        self._free = list(range(num_pages - 1, -1, -1))
        self._cached: set[int] = set()  # pages holding a cached block (in use or not), until evicted
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages with no reference, least recently used first
        self.on_evict: list[Callable[[int], None]] = []  # told the page before a cached page is reused

    def num_free(self) -> int:
        """Pages an allocation can take: the free list plus the idle cached pages (evicted when taken)."""
        return len(self._free) + len(self._idle)

    def num_idle_cached(self) -> int:
        """Cached pages no request uses: free to take, their content kept until then."""
        return len(self._idle)

    def refcount(self, page: int) -> int:
        self._check_page(page)
        return self._refcount[page]

    def can_allocate(self, n_pages: int) -> bool:
        return 0 <= n_pages <= self.num_free()

    def pages_for(self, num_tokens: int) -> int:
        """Number of pages needed to hold `num_tokens` tokens (ceil division)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages (ref count 1 each); raises PoolExhausted, changing nothing, if too few."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self.num_free():
            raise PoolExhausted(
                f"asked for {n} pages but only {self.num_free()} of {self.num_pages} are free; "
                "release or preempt a request, or raise num_pages"
            )
        pages = [self._take() for _ in range(n)]
        for page in pages:
            self._refcount[page] = 1
        return pages

    def _take(self) -> int:
        """A never-cached free page, else the least recently used idle cached page (its block evicted)."""
        if self._free:
            return self._free.pop()
        page, _ = self._idle.popitem(last=False)
        self._cached.discard(page)
        for hook in self.on_evict:
            hook(page)
        return page

    def mark_cached(self, page: int) -> None:
        """``page`` (in use) now holds a cached block: kept on the idle list when freed, until evicted."""
        self._check_page(page)
        if self._refcount[page] == 0:
            raise ValueError(f"page {page} is free; only a page in use can become cached")
        self._cached.add(page)

    def is_cached(self, page: int) -> bool:
        return page in self._cached

    def share(self, pages: Sequence[int]) -> None:
        """Add one reference to each page: in use, or idle cached (a prefix hit takes it back from the idle list)."""
        for page in pages:
            self._check_page(page)
            if self._refcount[page] == 0 and page not in self._idle:
                raise ValueError(f"page {page} is free and holds no cached block; allocate it instead of sharing it")
        for page in pages:
            self._idle.pop(page, None)
            self._refcount[page] += 1

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (for sharing). Every page must already be in use."""
        pages = list(pages)
        for page in pages:
            self._check_page(page)
            if self._refcount[page] == 0:
                raise ValueError(f"incref of page {page}, which is free; allocate it first")
        for page in pages:
            self._refcount[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference per listed page; at zero a page returns to the free list, or, holding a cached block,
        joins the idle list as its most recently used page (a request's last page first: evicted before its
        prefix). All-or-nothing."""
        counts = Counter(pages)
        for page, n in counts.items():
            self._check_page(page)
            if n > self._refcount[page]:
                raise ValueError(
                    f"double free of page {page}: freeing {n} reference(s) but its ref count is {self._refcount[page]}"
                )
        for page, n in reversed(counts.items()):  # reversed: a later allocate hands them out in this order again
            self._refcount[page] -= n
            if self._refcount[page] == 0:
                if page in self._cached:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    def _check_page(self, page: int) -> None:
        if not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise ValueError(f"page id {page!r} is out of range [0, {self.num_pages})")


@dataclass
class BlockTable:
    """Pages of one request, in position order, and how many tokens are valid."""

    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0

    def capacity(self, page_size: int) -> int:
        return len(self.pages) * page_size

    def slot(self, position: int, page_size: int) -> tuple[int, int]:
        """(page id, offset in page) of token `position`; the position must lie within the capacity."""
        if not 0 <= position < self.capacity(page_size):
            raise IndexError(
                f"position {position} is outside the table's capacity {self.capacity(page_size)}; "
                "call BlockManager.ensure_capacity first"
            )
        return self.pages[position // page_size], position % page_size


class BlockManager:
    """One BlockTable per request id, backed by a shared PageAllocator."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self._tables: dict[Hashable, BlockTable] = {}

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self._tables

    def request_ids(self) -> list[Hashable]:
        return list(self._tables)

    def table(self, req_id: Hashable) -> BlockTable:
        """The live table of `req_id` (treat as read-only)."""
        try:
            return self._tables[req_id]
        except KeyError:
            raise KeyError(f"no block table for request {req_id!r}; call ensure_capacity first") from None

    def ensure_capacity(self, req_id: Hashable, num_tokens: int) -> bool:
        """Grow the table of `req_id` to hold `num_tokens` tokens (creating it if needed).

        Returns False, changing nothing, when the pool cannot serve the growth. Does not change the length.
        """
        table = self._tables.get(req_id)
        have = 0 if table is None else len(table.pages)
        need = self.allocator.pages_for(num_tokens) - have
        if need > 0 and not self.allocator.can_allocate(need):
            return False
        if table is None:
            table = self._tables[req_id] = BlockTable()
        if need > 0:
            table.pages.extend(self.allocator.allocate(need))
        return True

    def share_prefix(self, req_id: Hashable, pages: Sequence[int]) -> None:
        """Start the table of `req_id` with cached pages (a prefix hit), shared by reference; its length covers
        them. The request writes only past them, into pages of its own."""
        if req_id in self._tables:
            raise ValueError(f"request {req_id!r} already has a block table; a prefix is shared only on admission")
        self.allocator.share(pages)
        self._tables[req_id] = BlockTable(list(pages), len(pages) * self.page_size)

    def set_length(self, req_id: Hashable, num_tokens: int, *, trim: bool = False) -> None:
        """Set the number of valid tokens (commit or rollback). No copies; frees pages only when `trim`."""
        table = self.table(req_id)
        cap = table.capacity(self.page_size)
        if not 0 <= num_tokens <= cap:
            raise ValueError(
                f"length {num_tokens} for request {req_id!r} is outside [0, capacity {cap}]; call ensure_capacity first"
            )
        table.num_tokens = num_tokens
        if trim:
            self.trim(req_id)

    def trim(self, req_id: Hashable) -> int:
        """Release whole pages past the current length; returns how many were released."""
        table = self.table(req_id)
        keep = self.allocator.pages_for(table.num_tokens)
        extra = table.pages[keep:]
        if extra:
            self.allocator.free(extra)
            del table.pages[keep:]
        return len(extra)

    def release(self, req_id: Hashable) -> None:
        """Free every page of `req_id` and forget it (finish or preemption)."""
        table = self.table(req_id)
        self.allocator.free(table.pages)
        del self._tables[req_id]

    def slots(self, req_id: Hashable, start: int, end: int) -> list[int]:
        """Flat slot ids page * page_size + offset for positions start..end-1 (all within capacity)."""
        table = self.table(req_id)
        size = self.page_size
        if not 0 <= start <= end <= table.capacity(size):
            raise IndexError(
                f"positions [{start}, {end}) of request {req_id!r} are outside its capacity "
                f"{table.capacity(size)}; call ensure_capacity first"
            )
        return [table.pages[p // size] * size + p % size for p in range(start, end)]
