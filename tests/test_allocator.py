"""Page allocator and block manager: ownership, exhaustion without side effects, rollback, slot mapping."""

import ast
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.cache.allocator import BlockManager, BlockTable, PageAllocator, PoolExhausted


def num_used(alloc: PageAllocator) -> int:
    return alloc.num_pages - alloc.num_free()


def test_module_imports_only_the_standard_library():
    import dspark.cache.allocator as mod

    tree = ast.parse(open(mod.__file__).read())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names


def test_allocate_free_and_refcount():
    alloc = PageAllocator(num_pages=4, page_size=16)
    assert (alloc.num_free(), num_used(alloc)) == (4, 0)
    pages = alloc.allocate(3)
    assert len(set(pages)) == 3 and all(0 <= p < 4 for p in pages)
    assert (alloc.num_free(), num_used(alloc)) == (1, 3)
    assert all(alloc.refcount(p) == 1 for p in pages)

    alloc.incref(pages[:1])
    alloc.free(pages)  # pages[0] still referenced once
    assert alloc.refcount(pages[0]) == 1 and alloc.refcount(pages[1]) == 0
    assert (alloc.num_free(), num_used(alloc)) == (3, 1)
    alloc.free(pages[:1])
    assert (alloc.num_free(), num_used(alloc)) == (4, 0)
    assert sorted(alloc.allocate(4)) == [0, 1, 2, 3]  # all pages came back, none twice


def test_exhaustion_raises_without_side_effects():
    alloc = PageAllocator(num_pages=3, page_size=4)
    held = alloc.allocate(2)
    assert alloc.can_allocate(1) and not alloc.can_allocate(2)
    with pytest.raises(PoolExhausted, match="asked for 2 pages but only 1"):
        alloc.allocate(2)
    assert (alloc.num_free(), num_used(alloc)) == (1, 2)
    (last,) = alloc.allocate(1)
    assert last not in held
    assert alloc.allocate(0) == []


def test_double_free_names_the_page():
    alloc = PageAllocator(num_pages=4, page_size=4)
    a, b = alloc.allocate(2)
    alloc.free([a])
    with pytest.raises(ValueError, match=f"double free of page {a}"):
        alloc.free([a])
    # all-or-nothing: b must not be freed when the batch holds a bad page
    with pytest.raises(ValueError, match=f"page {b}"):
        alloc.free([b, b])
    assert alloc.refcount(b) == 1 and alloc.num_free() == 3
    with pytest.raises(ValueError, match="out of range"):
        alloc.free([7])
    with pytest.raises(ValueError, match="free"):
        alloc.incref([a])


def test_pages_for_is_ceil():
    alloc = PageAllocator(num_pages=1, page_size=16)
    assert [alloc.pages_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_block_table_slot():
    table = BlockTable(pages=[5, 2], num_tokens=0)
    assert table.capacity(4) == 8
    assert table.slot(0, 4) == (5, 0)
    assert table.slot(3, 4) == (5, 3)
    assert table.slot(4, 4) == (2, 0)
    assert table.slot(7, 4) == (2, 3)
    with pytest.raises(IndexError):
        table.slot(8, 4)


def test_block_manager_grow_rollback_release():
    alloc = PageAllocator(num_pages=6, page_size=4)
    mgr = BlockManager(alloc)
    assert mgr.ensure_capacity("a", 5)  # 2 pages
    mgr.set_length("a", 5)
    assert mgr.ensure_capacity("a", 5 + 1 + 7)  # verify 7 drafts + bonus: 13 tokens -> 4 pages
    assert len(mgr.table("a").pages) == 4 and num_used(alloc) == 4
    pages_before = list(mgr.table("a").pages)

    mgr.set_length("a", 7)  # rollback: only the length moves
    assert mgr.table("a").num_tokens == 7
    assert mgr.table("a").pages == pages_before and num_used(alloc) == 4
    assert mgr.trim("a") == 2  # 7 tokens need 2 pages
    assert mgr.table("a").pages == pages_before[:2] and num_used(alloc) == 2
    mgr.set_length("a", 8, trim=True)  # exactly 2 pages: nothing released
    assert mgr.table("a").pages == pages_before[:2]
    with pytest.raises(ValueError, match="capacity"):
        mgr.set_length("a", 9)

    assert mgr.ensure_capacity("b", 16)  # 4 pages: pool now full
    assert alloc.num_free() == 0
    assert not mgr.ensure_capacity("c", 1)
    assert "c" not in mgr  # a failed grow creates nothing
    assert not mgr.ensure_capacity("a", 9)
    assert mgr.table("a").pages == pages_before[:2]  # and changes nothing
    mgr.release("a")
    mgr.release("b")
    assert alloc.num_free() == 6 and num_used(alloc) == 0
    with pytest.raises(KeyError, match="'a'"):
        mgr.table("a")


def test_slots_cross_page_boundaries():
    alloc = PageAllocator(num_pages=8, page_size=4)
    mgr = BlockManager(alloc)
    alloc.allocate(3)  # make the request's pages non-contiguous with position order
    assert mgr.ensure_capacity(1, 6)
    p0, p1 = mgr.table(1).pages
    assert mgr.slots(1, 0, 6) == [p0 * 4, p0 * 4 + 1, p0 * 4 + 2, p0 * 4 + 3, p1 * 4, p1 * 4 + 1]
    assert mgr.slots(1, 3, 5) == [p0 * 4 + 3, p1 * 4]
    assert mgr.slots(1, 2, 2) == []
    assert mgr.slots(1, 6, 8) == [p1 * 4 + 2, p1 * 4 + 3]
    for pos, s in zip(range(8), mgr.slots(1, 0, 8)):
        page, off = mgr.table(1).slot(pos, 4)
        assert s == page * 4 + off
    with pytest.raises(IndexError, match="capacity"):
        mgr.slots(1, 7, 9)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["grow", "set", "trim", "release"]),
        st.integers(0, 3),  # request id
        st.integers(0, 40),  # tokens
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, num_pages=st.integers(1, 12), page_size=st.integers(1, 5))
def test_random_ops_keep_pages_singly_owned(ops, num_pages, page_size):
    alloc = PageAllocator(num_pages, page_size)
    mgr = BlockManager(alloc)
    for op, rid, n in ops:
        if op == "grow":
            before = (alloc.num_free(), list(mgr.table(rid).pages) if rid in mgr else None)
            ok = mgr.ensure_capacity(rid, n)
            if ok:
                assert mgr.table(rid).capacity(page_size) >= n
            else:
                assert alloc.pages_for(n) - len(before[1] or []) > before[0]
                assert (alloc.num_free(), list(mgr.table(rid).pages) if rid in mgr else None) == before
        elif op == "set" and rid in mgr:
            m = min(n, mgr.table(rid).capacity(page_size))
            mgr.set_length(rid, m, trim=n % 2 == 0)
            assert mgr.table(rid).num_tokens == m
        elif op == "trim" and rid in mgr:
            mgr.trim(rid)
            assert len(mgr.table(rid).pages) == alloc.pages_for(mgr.table(rid).num_tokens)
        elif op == "release" and rid in mgr:
            mgr.release(rid)

        owned = [p for r in mgr.request_ids() for p in mgr.table(r).pages]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert alloc.num_free() + num_used(alloc) == num_pages
        assert num_used(alloc) == len(owned)
        assert all(alloc.refcount(p) == 1 for p in owned)
        for r in mgr.request_ids():
            assert mgr.table(r).num_tokens <= mgr.table(r).capacity(page_size)

    owned = [p for r in mgr.request_ids() for p in mgr.table(r).pages]
    rest = alloc.allocate(alloc.num_free())  # the free list must hold exactly the unowned pages
    assert sorted(rest + owned) == list(range(num_pages))
    alloc.free(rest)
    for r in mgr.request_ids():
        mgr.release(r)
    assert alloc.num_free() == num_pages and num_used(alloc) == 0
