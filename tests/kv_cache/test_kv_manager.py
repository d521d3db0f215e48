"""Tiny-pool unit tests for KVCacheManager that pin exact page ids and free-list order after each step.

page_size 8 throughout; a pool of 11 pages has usable pages 1..10 (page 0 is the null page).
"""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.kv_cache import NULL_PAGE, KVCacheManager, page_bounds
from paged_jax.kv_cache.invariants import check_manager_invariants
from pallas_kernels import common

PS = 8


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def snapshot(m: KVCacheManager) -> tuple:
    """Everything observable, to prove a failed call changed nothing."""
    tables = {rid: (m.page_ids(rid), m.num_computed_tokens(rid)) for rid in m.requests}
    refs = [m.page_ref_count(p) for p in range(m.num_pages)]
    return m.free_page_ids(), tables, refs, dict(m.pool.cached), m.stats()


@pytest.fixture
def m() -> KVCacheManager:
    return KVCacheManager(num_pages=11, page_size=PS)


def test_fresh_pool(m: KVCacheManager) -> None:
    assert m.free_page_ids() == list(range(1, 11))
    assert m.num_free_pages() == 10
    assert [m.pages_needed(n) for n in (0, 1, 8, 9, 16, 17)] == [0, 1, 1, 2, 2, 3]
    assert m.can_ever_fit(80) and not m.can_ever_fit(81)
    check_manager_invariants(m)


@pytest.mark.parametrize("bad", [0, 1, 4, 7, 12, 100, 512, 16.0, True])
def test_page_size_must_be_power_of_two_in_range(bad: object) -> None:
    with pytest.raises(ValueError, match="power of two"):
        KVCacheManager(num_pages=4, page_size=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("ok", [8, 16, 32, 64, 128, 256])
def test_every_allowed_page_size(ok: int) -> None:
    m = KVCacheManager(num_pages=4, page_size=ok)
    assert m.admit("a", toks(ok + 1), ok + 1) == 0
    assert m.page_ids("a") == [1, 2]
    check_manager_invariants(m)


def test_too_small_pool_rejected() -> None:
    with pytest.raises(ValueError, match="null page"):
        KVCacheManager(num_pages=1, page_size=8)


def test_admit_without_hits_then_prefix_hit(m: KVCacheManager) -> None:
    assert m.admit("a", toks(20), 20) == 0
    assert m.page_ids("a") == [1, 2, 3]
    assert m.num_computed_tokens("a") == 20
    assert m.free_page_ids() == list(range(4, 11))
    # Blocks 0 and 1 are full and cached, the partial block 2 is not.
    assert m.lookup_prefix(toks(20)) == 16
    assert m.lookup_prefix(toks(8) + [99] * 12) == 8
    assert m.lookup_prefix([99] + toks(19, 1)) == 0
    # b shares the first two blocks, then diverges.
    assert m.admit("b", toks(16) + [7, 7, 7], 3) == 16
    assert m.page_ids("b") == [1, 2, 4]
    assert [m.page_ref_count(p) for p in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert m.free_page_ids() == list(range(5, 11))
    st = m.stats()
    assert (st.prefix_queries, st.prefix_hits) == (39, 16)
    assert st.prefix_hit_rate == pytest.approx(16 / 39)
    check_manager_invariants(m)


def test_free_is_tail_first_and_eviction_is_lru(m: KVCacheManager) -> None:
    m.admit("a", toks(20), 20)
    m.free("a")
    # Partial page 3 holds nothing findable: head. Cached pages go to the tail, tail block first.
    assert m.free_page_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    assert m.stats().pages_cached_free == 2
    assert m.lookup_prefix(toks(20)) == 16  # freed pages stay findable
    assert m.admit("c", toks(64, 1000), 64) == 0
    assert m.page_ids("c") == [3, 4, 5, 6, 7, 8, 9, 10]
    assert m.free_page_ids() == [2, 1]
    assert m.stats().evictions == 0
    # The next page handed out is 2: its hash (block 1 of a) is evicted, block 0 stays findable.
    assert m.admit("d", toks(3, 2000), 3) == 0
    assert m.page_ids("d") == [2]
    assert m.stats().evictions == 1
    assert m.lookup_prefix(toks(20)) == 8
    check_manager_invariants(m)


def test_hit_on_free_page_takes_it_from_the_middle(m: KVCacheManager) -> None:
    m.admit("a", toks(20), 20)
    m.free("a")
    assert m.free_page_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    assert m.admit("b", toks(8) + [5] * 4, 4) == 8
    assert m.page_ids("b") == [1, 3]
    assert m.free_page_ids() == [4, 5, 6, 7, 8, 9, 10, 2]
    assert m.stats().pages_cached_free == 1
    check_manager_invariants(m)


def test_fully_cached_prompt_recomputes_last_token(m: KVCacheManager) -> None:
    m.admit("a", toks(16), 16)
    m.free("a")
    assert m.free_page_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    assert m.lookup_prefix(toks(16)) == 8
    assert m.lookup_prefix(toks(17)) == 16
    # The second block is recomputed into a fresh page; the hash already maps to page 2, so page 3
    # stays uncached (one page per hash).
    assert m.admit("b", toks(16), 16) == 8
    assert m.num_computed_tokens("b") == 16  # num_new_tokens clipped to len - cached
    assert m.page_ids("b") == [1, 3]
    assert m.pool.pages[3].block_hash is None
    m.free("b")
    assert m.free_page_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    check_manager_invariants(m)


def test_cache_salt_separates_tenants(m: KVCacheManager) -> None:
    m.admit("a", toks(17), 17, extra_keys=("tenant-1",))
    assert m.lookup_prefix(toks(17)) == 0
    assert m.lookup_prefix(toks(17), extra_keys=("tenant-2",)) == 0
    assert m.lookup_prefix(toks(17), extra_keys=("tenant-1",)) == 16
    assert m.admit("b", toks(17), 1, extra_keys=("tenant-1",)) == 16
    assert m.page_ids("b") == [1, 2, 4]
    check_manager_invariants(m)


def test_decode_growth_allocates_at_boundaries_and_caches_full_blocks(m: KVCacheManager) -> None:
    tokens = toks(7)
    assert m.admit("a", tokens, 7) == 0
    assert m.page_ids("a") == [1]
    for t in range(7, 17):
        tokens.append(t)
        assert m.allocate_slots("a", tokens, 1) == []
        check_manager_invariants(m)
    assert m.page_ids("a") == [1, 2, 3]
    assert m.num_computed_tokens("a") == 17
    assert m.lookup_prefix(toks(17)) == 16
    assert m.allocate_slots("a", tokens, 0) == []  # nothing to compute: nothing changes
    assert m.page_ids("a") == [1, 2, 3]


def test_chunked_prefill(m: KVCacheManager) -> None:
    prompt = toks(30)
    assert m.admit("a", prompt, 10) == 0
    assert (m.page_ids("a"), m.num_computed_tokens("a")) == ([1, 2], 10)
    assert m.lookup_prefix(prompt) == 8
    assert m.allocate_slots("a", prompt, 20) == []
    assert (m.page_ids("a"), m.num_computed_tokens("a")) == ([1, 2, 3, 4], 30)
    assert m.lookup_prefix(prompt) == 24
    check_manager_invariants(m)


def test_fork_then_copy_on_write(m: KVCacheManager) -> None:
    tokens = toks(12)
    m.admit("p", tokens, 12)
    m.fork("p", "c")
    assert m.page_ids("c") == [1, 2]
    assert [m.page_ref_count(p) for p in (1, 2)] == [2, 2]
    check_manager_invariants(m)
    # The child writes into the shared partial page 2: private copy on page 3.
    assert m.allocate_slots("c", tokens + [100], 1) == [(2, 3)]
    assert m.page_ids("c") == [1, 3]
    assert [m.page_ref_count(p) for p in (1, 2, 3)] == [2, 1, 1]
    # The parent now owns page 2 alone and writes in place.
    assert m.allocate_slots("p", tokens + [200], 1) == []
    assert m.page_ids("p") == [1, 2]
    assert m.free_page_ids() == list(range(4, 11))
    check_manager_invariants(m)


def test_fork_at_page_boundary_needs_no_copy(m: KVCacheManager) -> None:
    m.admit("p", toks(16), 16)
    m.fork("p", "c")
    assert m.allocate_slots("c", toks(16) + [1], 1) == []
    assert m.page_ids("c") == [1, 2, 3]
    assert m.page_ids("p") == [1, 2]
    check_manager_invariants(m)


def test_identical_blocks_in_one_step_keep_one_cache_entry(m: KVCacheManager) -> None:
    tokens = toks(12)
    m.admit("p", tokens, 12)
    m.fork("p", "c")
    done = tokens + toks(4, 50)  # both complete block 1 with the same tokens in the same step
    assert m.allocate_slots("p", done, 4) == [(2, 3)]  # p writes first, so p copies
    assert m.allocate_slots("c", done, 4) == []
    assert (m.page_ids("p"), m.page_ids("c")) == ([1, 3], [1, 2])
    (entry,) = [b.page_id for b in m.pool.cached.values() if b.page_id != 1]
    assert entry == 3  # the first to complete the block owns the entry; page 2 stays uncached
    assert m.pool.pages[2].block_hash is None
    m.free("c")
    assert m.free_page_ids() == [2] + list(range(4, 11))
    assert m.lookup_prefix(done + [0]) == 16
    check_manager_invariants(m)


def test_preempt_and_resume_hits_own_blocks(m: KVCacheManager) -> None:
    tokens = toks(25)
    m.admit("a", tokens, 25)
    assert m.page_ids("a") == [1, 2, 3, 4]
    m.free("a")  # preempted
    assert m.free_page_ids() == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    assert m.admit("a", tokens, 100) == 24
    assert m.page_ids("a") == [1, 2, 3, 4]
    assert m.num_computed_tokens("a") == 25
    check_manager_invariants(m)


def test_failed_admit_and_allocate_change_nothing(m: KVCacheManager) -> None:
    m.admit("a", toks(20), 20)
    m.free("a")
    m.admit("b", toks(48, 500), 48)  # 6 pages: 3..8
    assert m.free_page_ids() == [9, 10, 2, 1]
    before = snapshot(m)
    # a's prompt hits pages 1 and 2 (both free), then needs 3 more: 2 + 3 > 4 free.
    assert m.admit("a", toks(16) + [1] * 24, 24) is None
    assert "a" not in m
    # Exactly enough: 2 revived + 2 new.
    assert m.admit("a", toks(16) + [1] * 16, 16) == 16
    assert m.page_ids("a") == [1, 2, 9, 10]
    assert m.free_page_ids() == []
    before = snapshot(m)
    assert m.allocate_slots("b", toks(48, 500) + [0], 1) is None
    assert snapshot(m) == before
    check_manager_invariants(m)


def test_copy_on_write_counts_toward_all_or_nothing() -> None:
    m = KVCacheManager(num_pages=3, page_size=PS)
    m.admit("p", toks(4), 4)
    m.fork("p", "c")
    m.admit("x", toks(8, 100), 8)
    assert m.free_page_ids() == []
    before = snapshot(m)
    assert m.allocate_slots("c", toks(5), 1) is None
    assert snapshot(m) == before
    m.free("x")
    assert m.allocate_slots("c", toks(5), 1) == [(1, 2)]
    check_manager_invariants(m)


def test_bad_input_raises_and_changes_nothing(m: KVCacheManager) -> None:
    m.admit("a", toks(10), 10)
    m.fork("a", "b")
    before = snapshot(m)
    cases = [
        (KeyError, lambda: m.free("zz")),
        (KeyError, lambda: m.allocate_slots("zz", toks(3), 1)),
        (KeyError, lambda: m.page_ids("zz")),
        (KeyError, lambda: m.num_computed_tokens("zz")),
        (KeyError, lambda: m.fork("zz", "c")),
        (ValueError, lambda: m.fork("a", "b")),
        (ValueError, lambda: m.admit("a", toks(3), 3)),
        (ValueError, lambda: m.admit("c", [], 1)),
        (ValueError, lambda: m.admit("c", toks(3), 0)),
        (ValueError, lambda: m.admit("c", toks(81), 81)),  # 11 pages > 10 in the pool
        (ValueError, lambda: m.allocate_slots("a", toks(90), 80)),
        (ValueError, lambda: m.allocate_slots("a", toks(10), 1)),  # token 10 not given
        (ValueError, lambda: m.allocate_slots("a", toks(10), -1)),
        (ValueError, lambda: m.block_table_row("a", 1)),
    ]
    for exc, call in cases:
        with pytest.raises(exc):
            call()
        assert snapshot(m) == before
    m.free("a")
    with pytest.raises(KeyError, match="unknown request 'a'"):
        m.free("a")  # double free
    check_manager_invariants(m)


def test_block_table_row(m: KVCacheManager) -> None:
    m.admit("a", toks(20), 20)
    row = m.block_table_row("a", 6)
    assert row.dtype == np.int32
    assert row.tolist() == [1, 2, 3, NULL_PAGE, NULL_PAGE, NULL_PAGE]


def test_stats(m: KVCacheManager) -> None:
    st = m.stats()
    assert (st.pages_total, st.pages_free, st.pages_in_use, st.slot_utilization) == (10, 10, 0, 1.0)
    m.admit("a", toks(20), 20)
    m.fork("a", "b")
    m.admit("c", toks(4, 300), 4)
    st = m.stats()
    assert (st.pages_free, st.pages_in_use, st.pages_cached_free) == (6, 4, 0)
    # Live slots: 8 + 8 + 4 (page 3, shared) + 4 (page 4) over 4 pages of 8 slots.
    assert st.slot_utilization == pytest.approx(24 / 32)
    m.free("a")
    m.free("b")
    st = m.stats()
    assert (st.pages_free, st.pages_cached_free, st.evictions) == (9, 2, 0)


def test_prefix_caching_disabled() -> None:
    m = KVCacheManager(num_pages=6, page_size=PS, enable_prefix_caching=False)
    m.admit("a", toks(20), 20)
    assert m.lookup_prefix(toks(20)) == 0
    m.free("a")
    assert m.free_page_ids() == [1, 2, 3, 4, 5]  # nothing cached: every freed page goes to the head
    assert m.admit("b", toks(20), 20) == 0
    assert m.stats().pages_cached_free == 0
    check_manager_invariants(m)


def _corrupted_manager() -> KVCacheManager:
    m = KVCacheManager(num_pages=11, page_size=PS)
    m.admit("a", toks(20), 20)
    m.free("a")
    m.admit("b", toks(9, 100), 9)
    check_manager_invariants(m)
    return m


@pytest.mark.parametrize("kind", ["refcount", "free list", "null page", "stale hash", "cache map"])
def test_check_invariants_detects_corruption(kind: str) -> None:
    m = _corrupted_manager()
    pool = m.pool
    if kind == "refcount":
        pool.pages[3].ref_cnt += 1
    elif kind == "free list":
        pool.free_queue.remove(pool.pages[2])  # a refcount-0 page missing from the list
    elif kind == "null page":
        m.requests["b"].tables[0].append(pool.pages[0])
    elif kind == "stale hash":
        pool.pages[1].block_hash = None  # map still points at page 1
    else:
        pool.cached.pop(next(iter(pool.cached)))  # a page carrying a hash the map forgot
    with pytest.raises(RuntimeError, match="invariant broken"):
        check_manager_invariants(m)


def test_page_bounds_agree_with_the_kernels():
    """The host keeps its own page bounds and ceiling division (so it imports no JAX); they are the kernels'."""
    assert (page_bounds.MIN_PAGE_SIZE, page_bounds.MAX_PAGE_SIZE) == (common.MIN_PAGE_SIZE, common.MAX_PAGE_SIZE)
    for a in range(0, 40):
        for b in (1, 7, 8, 16):
            assert page_bounds.cdiv(a, b) == common.cdiv(a, b) == -(-a // b)
