"""KV cache groups: exact page ids of every group's table, window drops, prefix hits every group can serve.

page_size 8; group 0 is full attention, group 1 slides by 8 tokens (a query at x reads keys x - 7 .. x), so a
step starting at position s drops the window group's blocks below (s - 7) // 8.
"""

from __future__ import annotations

import pytest

from paged_jax.config import ModelConfig
from paged_jax.kv_cache import NULL_PAGE, KVCacheManager, KVGroup, kv_layout
from paged_jax.kv_cache.invariants import check_manager_invariants

PS = 8
HYBRID = (KVGroup(None, (1,)), KVGroup(8, (0,)))


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def snapshot(m: KVCacheManager) -> tuple:
    tables = {rid: (m.block_tables(rid), m.num_computed_tokens(rid)) for rid in m.requests}
    cached = {key: page.page_id for key, page in m.pool.cached.items()}
    return m.free_page_ids(), tables, [m.page_ref_count(p) for p in range(m.num_pages)], cached


def hybrid(num_pages: int = 11) -> KVCacheManager:
    return KVCacheManager(num_pages, PS, groups=HYBRID)


def test_layout_of_gemma3_4b_shapes() -> None:
    cfg = ModelConfig(num_layers=34, sliding_window=1024, sliding_window_pattern=6)
    layout = kv_layout(cfg)
    assert layout.slots_per_page == 5
    assert [g.window for g in layout.groups] == [None] + [1024] * 6
    assert layout.groups[0].layers == (5, 11, 17, 23, 29)
    assert [len(g.layers) for g in layout.groups[1:]] == [5, 5, 5, 5, 5, 4]
    assert sorted(layer for g in layout.groups for layer in g.layers) == list(range(34))
    slots = layout.slot_of_layer(34)
    assert slots[5] == 0 and slots[0] == 0 and slots[4] == 4 and slots[6] == 0
    assert layout.group_of_layer(34)[:7] == (1, 1, 1, 1, 1, 0, 2)
    # No windows, or every layer sliding: one group of every layer (the layout without groups).
    for cfg in (ModelConfig(num_layers=4), ModelConfig(num_layers=4, sliding_window=64)):
        one = kv_layout(cfg)
        assert one.slots_per_page == 4 and len(one.groups) == 1 and one.groups[0].layers == (0, 1, 2, 3)
    assert kv_layout(cfg).groups[0].window == 64
    assert kv_layout(cfg, hybrid=False).windows == (None,)  # off: full-length pages, every layer sliding too
    gemma = ModelConfig(num_layers=34, sliding_window=1024, sliding_window_pattern=6)
    assert kv_layout(gemma, hybrid=False).windows == (None,)


def test_admit_allocates_every_group_then_window_drops() -> None:
    m = hybrid()
    assert m.admit("a", toks(20), 20) == 0
    assert m.block_tables("a") == [[1, 2, 3], [4, 5, 6]]
    # The step at 20 reads keys 13.. : block 0 of the window group leaves (cached, so it stays findable at the tail).
    assert m.allocate_slots("a", toks(21), 1) == []
    assert m.block_tables("a") == [[1, 2, 3], [NULL_PAGE, 5, 6]]
    assert m.free_page_ids() == [7, 8, 9, 10, 4]
    assert m.page_ref_count(4) == 0 and m.pool.pages[4].block_hash is not None
    check_manager_invariants(m)
    # Growing to 24 + 1 tokens: a new page in both groups; the step at 24 reads 17.. : block 1 (page 5) leaves too.
    for n in range(22, 25):
        assert m.allocate_slots("a", toks(n), 1) == []
    assert m.allocate_slots("a", toks(25), 1) == []
    assert m.block_tables("a") == [[1, 2, 3, 7], [NULL_PAGE, NULL_PAGE, 6, 8]]
    assert m.free_page_ids() == [9, 10, 4, 5]
    st = m.stats()
    assert [(g.window, g.pages_in_use) for g in st.groups] == [(None, 4), (8, 2)]
    # 25 tokens in 6 pages of 8: 23 empty slots... 7 in each group's last page; the window group's first live
    # page (block 2, keys 16..23) has 18 - 16 = 2 slots below the reach of the query at 25 (keys 18..).
    assert st.slot_utilization == pytest.approx((48 - 14) / 48)
    assert st.kv_utilization == pytest.approx((32 - 7 + 16 - 7 - 2) / 48)
    check_manager_invariants(m)
    m.free("a")
    assert m.num_free_pages() == 10
    check_manager_invariants(m)


def test_uncached_window_page_is_freed_at_the_head() -> None:
    m = KVCacheManager(11, PS, enable_prefix_caching=False, groups=HYBRID)
    assert m.admit("a", toks(20), 20) == 0
    assert m.allocate_slots("a", toks(21), 1) == []
    assert m.free_page_ids() == [4, 7, 8, 9, 10]  # nothing to find again: reused first
    check_manager_invariants(m)


def test_chunked_prefill_drops_as_it_goes() -> None:
    m = KVCacheManager(64, PS, groups=HYBRID, max_step_tokens=16)
    prompt = toks(200)
    assert m.admit("a", prompt, 16) == 0
    held = []
    while m.num_computed_tokens("a") < 200:
        assert m.allocate_slots("a", prompt, min(16, 200 - m.num_computed_tokens("a"))) is not None
        held.append(sum(p != NULL_PAGE for p in m.block_tables("a")[1]))
        check_manager_invariants(m)
    # A chunk of 16 from s reads keys s - 7 ..: at most ceil((7 + 16) / 8) + 1 window pages, never the prompt's 25.
    assert m.peak_pages(200) - m.pages_needed(200) == 4
    assert max(held) == 3
    full = m.block_tables("a")[0]
    assert len(full) == 25 and NULL_PAGE not in full
    m.free("a")
    assert m.num_free_pages() == 63


def test_prefix_hit_needs_the_window_blocks_too() -> None:
    m = hybrid(21)
    a = toks(41)
    assert m.admit("a", a, 41) == 0
    assert m.block_tables("a") == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    assert m.allocate_slots("a", a + [99], 1) == []  # the step at 41 reads keys 34..: window blocks 0..3 leave
    assert m.block_tables("a") == [[1, 2, 3, 4, 5, 6], [NULL_PAGE] * 4 + [11, 12]]
    assert m.free_page_ids() == [13, 14, 15, 16, 17, 18, 19, 20, 7, 8, 9, 10]
    # Every group serves 3 blocks of a 25-token prompt: the window group's dropped pages are still cached.
    assert m.lookup_prefix(a[:25]) == 24
    # Five pages per group evict the 8 plain pages, then the window group's blocks 0 and 1 (pages 7, 8).
    assert m.admit("x", toks(40, 500), 40) == 0
    assert m.block_tables("x") == [[13, 14, 15, 16, 17], [18, 19, 20, 7, 8]]
    assert m.stats().evictions == 2
    # A hit of 3 blocks needs only window block 2 (page 9): still 24. Of a 17-token prompt (at most 2 blocks),
    # a hit of 2 needs window block 1, of 1 block 0: both evicted, so no hit although full attention has both.
    assert m.lookup_prefix(a[:25]) == 24
    assert m.lookup_prefix(a[:17]) == 0
    m.free("x")
    assert m.admit("c", a[:25], 25) == 24
    assert m.block_tables("c") == [[1, 2, 3, 10], [NULL_PAGE, NULL_PAGE, 9, 17]]
    check_manager_invariants(m)
    for rid in ("a", "c"):
        m.free(rid)
    assert m.num_free_pages() == 20
    check_manager_invariants(m)


def test_fixed_point_lowers_the_hit_to_what_the_window_group_caches() -> None:
    m = hybrid(20)
    a = toks(41)
    assert m.admit("a", a, 41) == 0
    assert m.allocate_slots("a", a + [99], 1) == []
    # Drop the window group's cached copies of blocks 1 and 2 (as eviction would) and keep block 0.
    for i in (1, 2):
        key = m.cache_key(m.requests["a"].block_hashes[i], 1)
        page = m.pool.cached.pop(key)
        page.block_hash = None
        m.pool.num_cached_free -= 1
    check_manager_invariants(m)
    # Full attention serves 3 blocks; the window group at 3 needs block 2 (missing), at 2 block 1 (missing), at 1
    # block 0 (cached): the fixed point is 1 block.
    assert m.lookup_prefix(a[:25]) == 8
    assert m.admit("c", a[:25], 25) == 8
    assert m.block_tables("c")[0][0] == m.block_tables("a")[0][0]
    assert m.block_tables("c")[1][0] != NULL_PAGE
    check_manager_invariants(m)


def test_extra_keys_separate_groups_hits() -> None:
    m = hybrid(20)
    assert m.admit("a", toks(17), 17, extra_keys=("salt:x",)) == 0
    assert m.lookup_prefix(toks(17), ("salt:x",)) == 16
    assert m.lookup_prefix(toks(17)) == 0
    assert m.lookup_prefix(toks(17), ("salt:y",)) == 0


def test_fork_and_copy_on_write_in_every_group() -> None:
    m = hybrid(20)
    assert m.admit("p", toks(12), 12) == 0
    assert m.block_tables("p") == [[1, 2], [3, 4]]
    m.fork("p", "c")
    assert [m.page_ref_count(p) for p in (1, 2, 3, 4)] == [2, 2, 2, 2]
    copies = m.allocate_slots("c", toks(13), 1)
    assert copies == [(2, 5), (4, 6)]
    assert m.block_tables("c") == [[1, 5], [3, 6]]
    assert m.allocate_slots("p", toks(13), 1) == []  # the parent is its last page's only holder now
    check_manager_invariants(m)
    m.free("p")
    m.free("c")
    assert m.num_free_pages() == 19
    check_manager_invariants(m)


def test_all_or_nothing_counts_the_pages_a_drop_frees() -> None:
    m = KVCacheManager(7, PS, enable_prefix_caching=False, groups=HYBRID)  # 6 usable pages
    assert m.admit("a", toks(24), 24) == 0  # 3 + 3 pages: the pool is full
    assert m.num_free_pages() == 0
    # The step at 24 drops window blocks 0, 1 (2 pages back), and needs one page per group: it fits.
    assert m.allocate_slots("a", toks(25), 1) == []
    assert m.block_tables("a") == [[1, 2, 3, 5], [NULL_PAGE, NULL_PAGE, 6, 4]]
    check_manager_invariants(m)
    # A second request cannot fit; the failed call changes nothing.
    before = snapshot(m)
    assert m.admit("b", toks(9, 100), 9) is None
    assert snapshot(m) == before


def test_drafts_roll_back_in_every_group() -> None:
    m = hybrid(20)
    assert m.admit("a", toks(15), 15) == 0
    assert m.allocate_slots("a", toks(16), 1, num_draft=3) == []
    assert [len(t) for t in m.block_tables("a")] == [3, 3]
    m.accept_drafts("a", 0, toks(16))
    assert [len(t) for t in m.block_tables("a")] == [2, 2]
    check_manager_invariants(m)


def test_can_ever_fit_counts_window_groups_by_their_reach() -> None:
    m = KVCacheManager(11, PS, groups=HYBRID, max_step_tokens=8)
    # 10 usable pages: 80 tokens need 10 full-attention pages alone; 40 need 5 + at most 3 window pages.
    assert m.peak_pages(40) == 5 + 3
    assert m.can_ever_fit(40) and not m.can_ever_fit(80)


def test_one_group_is_exactly_the_manager_without_groups() -> None:
    a, b = KVCacheManager(11, PS), KVCacheManager(11, PS, groups=(KVGroup(None, (0, 1)),))
    for m in (a, b):
        m.admit("r", toks(20), 20)
        m.allocate_slots("r", toks(21), 1)
        m.fork("r", "s")
        m.allocate_slots("s", toks(22), 1)
    assert snapshot(a) == snapshot(b)


@pytest.mark.parametrize("window", [3, 8, 20])
def test_uniform_window_model_drops_in_its_one_group(window: int) -> None:
    m = KVCacheManager(30, PS, groups=(KVGroup(window, (0, 1)),))
    prompt = toks(60)
    assert m.admit("a", prompt, 60) == 0
    assert m.allocate_slots("a", prompt + [1], 1) == []
    lo = m.first_readable_block(60, window)
    assert m.block_tables("a")[0][:lo] == [NULL_PAGE] * lo and NULL_PAGE not in m.block_tables("a")[0][lo:]
    # A hit of the whole prompt needs only the blocks the window still reads: the dropped ones are cached.
    assert m.lookup_prefix(prompt + [1]) == 56
    check_manager_invariants(m)
