"""The host tier's bookkeeping in the KV manager (no device): an evicted cached page is offloaded under its exact
cache key, an in-flight entry is no hit until the step is taken, a device miss that the tier holds is restored into
a fresh page cached under the same key, slots claimed or offloaded in a step are never reused in it, LRU within the
tier, and the keys (salt, group) separate entries as on the device. Exact page and slot ids are pinned."""

from __future__ import annotations

import pytest

from paged_jax.kv_cache import FULL, HostTier, KVCacheManager, KVGroup, SlotCopy
from paged_jax.kv_cache.invariants import check_manager_invariants

PS = 8


def manager(num_pages: int, capacity: int, groups=(FULL,)) -> tuple[KVCacheManager, HostTier]:
    tier = HostTier(capacity)
    return KVCacheManager(num_pages, PS, groups=groups, host_tier=tier), tier


def fill(m: KVCacheManager, rid: str, tokens: list[int]) -> None:
    """Admit and compute every token of `tokens`, then free it (its full blocks stay cached, free)."""
    assert m.admit(rid, tokens, len(tokens)) is not None
    m.free(rid)


def test_eviction_offloads_under_the_cache_key_and_restores_after_the_step():
    m, tier = manager(num_pages=5, capacity=8)  # 4 usable pages
    a = list(range(100, 100 + 2 * PS + 1))  # 2 full blocks + 1 token
    fill(m, "a", a)
    assert m.take_transfers() is None  # nothing evicted yet
    hashes = m.hasher.extend([], a, 2)
    # b takes every page: the pool hands out a's hash-less page and the unused one first, then evicts a's cached
    # pages, the one ending the longer prefix first
    b = list(range(200, 200 + 4 * PS))
    assert m.admit("b", b, len(b)) == 0
    transfers = m.take_transfers()
    assert transfers is not None and not transfers.restores
    assert transfers.offloads == [SlotCopy(2, 0, hashes[1]), SlotCopy(1, 1, hashes[0])]
    assert m.page_ids("b") == [3, 4, 2, 1]
    assert set(tier.entries) == set(hashes) and len(tier) == 2
    m.free("b")
    # a again: both blocks miss on the device (b's blocks took their pages) but hit in the tier
    assert m.lookup_prefix(a) == 2 * PS
    assert m.admit("a2", a, 1) == 2 * PS
    transfers = m.take_transfers()
    assert transfers is not None
    restored = [c.page for c in transfers.restores]
    assert restored == m.page_ids("a2")[:2]
    assert [c.slot for c in transfers.restores] == [tier.entries[h] for h in hashes]
    assert all(m.pool.pages[p].block_hash == h for p, h in zip(restored, hashes, strict=True))
    st = m.stats()
    assert st.prefix_hits == 2 * PS and st.prefix_hits_host == 2 * PS
    # a2's 3 pages evicted b's cached ones (its 4 full blocks, the first 3 offloaded now): 2 + 3 held
    assert st.host is not None and st.host.hits == 2 and st.host.pages_held == st.host.offloads == 5
    assert len(transfers.offloads) == 3
    check_manager_invariants(m)
    tier.check()


def test_in_flight_entries_are_no_hit_until_the_step_is_taken():
    m, tier = manager(num_pages=4, capacity=8)  # 3 usable pages
    a = list(range(50, 50 + 2 * PS + 1))
    fill(m, "a", a)
    assert m.admit("b", list(range(300, 300 + 3 * PS)), 3 * PS) == 0  # evicts a's two cached pages
    m.free("b")
    # same step: a's blocks are in flight (their bytes reach the host only when the worker runs this step)
    assert m.lookup_prefix(a) == 0
    assert m.take_transfers() is not None
    assert m.lookup_prefix(a) == 2 * PS


def test_slots_read_or_written_in_a_step_are_not_reused_in_it():
    m, tier = manager(num_pages=4, capacity=2)  # 3 usable pages, 2 host slots
    a = list(range(10, 10 + 2 * PS + 1))
    fill(m, "a", a)
    assert m.admit("b", list(range(400, 400 + 3 * PS)), 3 * PS) == 0  # a's 2 blocks -> slots 0, 1
    m.free("b")
    t = m.take_transfers()
    assert t is not None and sorted(c.slot for c in t.offloads) == [0, 1]
    # a restores both slots; allocating their pages evicts b's cached pages, whose offloads find every slot
    # pinned: they are dropped, not written over the slots being read
    assert m.admit("a2", a, 1) == 2 * PS
    t = m.take_transfers()
    assert t is not None and not t.offloads and sorted(c.slot for c in t.restores) == [0, 1]
    assert set(tier.entries) == set(m.hasher.extend([], a, 2))
    m.free("a2")
    tier.check()


def test_lru_within_the_tier_and_inclusive_restores():
    tier = HostTier(2)
    keys = [bytes([i]) * 16 for i in range(3)]
    tier.offload(keys[0], 5)
    tier.offload(keys[1], 6)
    tier.take()
    assert tier.claim(keys[0]) in (0, 1)  # keys[0] becomes most recently used
    tier.take()
    tier.offload(keys[2], 7)  # full: the least recently used (keys[1]) goes
    assert list(tier.entries) == [keys[0], keys[2]] and tier.evictions == 1
    t = tier.take()
    assert t is not None and t.offloads == [SlotCopy(7, 1, keys[2])]
    tier.offload(keys[0], 9)  # already held: no copy, only recency
    assert tier.take() is None and list(tier.entries) == [keys[2], keys[0]]


def test_salt_and_group_keys_separate_host_entries():
    groups = (KVGroup(None, (0,)), KVGroup(None, (1,)))
    m, tier = manager(num_pages=7, capacity=16, groups=groups)  # 6 usable pages: 3 blocks x 2 groups
    a = list(range(60, 60 + 2 * PS + 1))
    assert m.admit("a", a, len(a), extra_keys=("salt1",)) is not None
    m.free("a")
    assert m.admit("b", list(range(500, 500 + 3 * PS)), 3 * PS) == 0  # evicts a's 2 blocks in both groups
    m.free("b")
    m.take_transfers()
    assert len(tier) == 4  # per group its own entry
    assert m.lookup_prefix(a) == 0  # another salt: no hit in either tier
    assert m.lookup_prefix(a, ("salt1",)) == 2 * PS
    assert m.admit("a2", a, 1, extra_keys=("salt1",)) == 2 * PS
    t = m.take_transfers()
    assert t is not None and len(t.restores) == 4
    check_manager_invariants(m)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        HostTier(0)
