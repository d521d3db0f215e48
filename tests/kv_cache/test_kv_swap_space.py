"""Swap on preemption in the KV manager (no device): a swapped-out request's live pages (full blocks, the partial
last one, a window group's live blocks only) are copied into reserved host slots that no lookup finds and the LRU
never reuses; swapping in gives it fresh pages, the same tables and counts, its full blocks cached again, and
copies each slot back; a step that runs nothing cancels its swap-outs; an abort returns the slots; the restore
lookup counts the pages only the host tier holds. Exact pages and slots are pinned."""

from __future__ import annotations

from paged_jax.kv_cache import FULL, HostTier, KVCacheManager, KVGroup, SlotCopy, SwapCosts, SwapSpace
from paged_jax.kv_cache.invariants import check_manager_invariants

PS = 8
FREE = SwapCosts(copy_bytes_per_s=1e30, flops_per_s=1.0, flops_per_token=1.0, attention_flops=0.0, page_bytes=1)


def space(num_pages: int, capacity: int, groups=(FULL,)) -> tuple[KVCacheManager, HostTier, SwapSpace]:
    tier = HostTier(capacity)
    kv = KVCacheManager(num_pages, PS, groups=groups, host_tier=tier)
    return kv, tier, SwapSpace(kv, tier, FREE, "swap")


def check(kv: KVCacheManager, tier: HostTier, swap: SwapSpace) -> None:
    check_manager_invariants(kv)
    tier.check()
    swap.check()


def test_swap_out_and_in_keeps_tables_counts_and_bytes():
    kv, tier, swap = space(num_pages=8, capacity=6)
    a = list(range(100, 100 + 2 * PS + 3))  # 2 full blocks + a partial one
    assert kv.admit("a", a, len(a)) == 0
    assert kv.take_transfers() is None
    before = kv.page_ids("a")
    hashes = list(kv.requests["a"].block_hashes)
    assert swap.swap_out("a")
    assert "a" not in kv and "a" in swap and swap.pages("a") == 3
    out = tier.pending.offloads
    assert out == [SlotCopy(before[0], 0), SlotCopy(before[1], 1), SlotCopy(before[2], 2)]
    assert tier.reserved == {0, 1, 2} and tier.swap_in_flight == {0, 1, 2} and not tier.entries
    assert kv.lookup_prefix(a) == 2 * PS  # the full blocks stay cached on the device (freed, evictable)
    check(kv, tier, swap)
    assert swap.end_step(runs=True) == []
    transfers = kv.take_transfers()
    assert transfers is not None and len(transfers.offloads) == 3 and not tier.swap_in_flight
    # b takes most pages, evicting a's cached blocks: they are offloaded as entries, apart from the reservation
    b = list(range(300, 300 + 7 * PS))  # every page
    assert kv.admit("b", b, len(b)) == 0
    assert {c.slot for c in tier.pending.offloads} == {3, 4} and tier.reserved == {0, 1, 2}
    kv.take_transfers()
    kv.free("b")
    assert swap.swap_in("a", a)
    assert kv.num_computed_tokens("a") == len(a) and kv.requests["a"].block_hashes == hashes
    after = kv.page_ids("a")
    restores = tier.pending.restores
    assert [(c.slot, c.page) for c in restores] == [(0, after[0]), (1, after[1]), (2, after[2])]
    assert [kv.pool.pages[p].block_hash for p in after] == [hashes[0], hashes[1], None]  # cached again
    assert not tier.reserved and "a" not in swap
    assert kv.allocate_slots("a", a + [7], 1) == []  # continues where it stopped
    check(kv, tier, swap)
    st = kv.stats().host
    assert st is not None and st.swap_outs == st.swap_ins == 1 and st.swap_pages_held == 0


def test_a_step_that_runs_nothing_cancels_and_an_abort_returns_the_slots():
    kv, tier, swap = space(num_pages=8, capacity=4)
    a = list(range(100, 100 + PS + 1))
    kv.admit("a", a, len(a))
    kv.take_transfers()
    assert swap.swap_out("a") and tier.reserved == {0, 1}
    assert swap.end_step(runs=False) == ["a"]  # its copies would never run: recomputed instead
    assert not tier.reserved and not tier.pending.offloads and "a" not in swap
    check(kv, tier, swap)
    kv.admit("a", a, len(a))
    kv.take_transfers()
    assert swap.swap_out("a")
    swap.end_step(runs=True)
    kv.take_transfers()
    swap.drop("a")  # aborted while swapped out
    assert not tier.reserved and sorted(tier.free_slots) == [0, 1, 2, 3]
    check(kv, tier, swap)


def test_a_full_tier_refuses_and_window_groups_swap_live_blocks_only():
    kv, tier, swap = space(num_pages=8, capacity=2)
    a = list(range(100, 100 + 2 * PS + 1))  # 3 pages: more than the tier's slots
    kv.admit("a", a, len(a))
    assert not swap.swap_out("a") and "a" in kv and not tier.reserved
    kv.free("a")
    groups = (FULL, KVGroup(window=PS, layers=(1,)))
    kv, tier, swap = space(num_pages=16, capacity=8, groups=groups)
    w = list(range(100, 100 + 3 * PS + 2))
    kv.admit("w", w, 2 * PS)
    kv.allocate_slots("w", w, len(w) - 2 * PS)  # from 16 on no query reads block 0 of the window group
    kv.take_transfers()
    tables = kv.block_tables("w")
    assert tables[1][0] == 0 and 0 not in tables[1][1:] and 0 not in tables[0]
    assert swap.swap_out("w") and swap.pages("w") == 4 + 3
    swap.end_step(runs=True)
    kv.take_transfers()
    assert swap.swap_in("w", w)
    assert [[p != 0 for p in t] for t in kv.block_tables("w")] == [[p != 0 for p in t] for t in tables]
    check(kv, tier, swap)


def test_restore_lookup_counts_pages_only_the_host_tier_holds():
    kv, tier, _ = space(num_pages=5, capacity=8)
    a = list(range(100, 100 + 2 * PS + 1))
    kv.admit("a", a, len(a))
    kv.free("a")
    assert kv.lookup_restores(a) == (2 * PS, 0)  # both on the device
    b = list(range(200, 200 + 4 * PS))
    kv.admit("b", b, len(b))  # evicts a's blocks into the tier
    kv.take_transfers()
    kv.free("b")
    assert kv.lookup_restores(a) == (2 * PS, 2)
