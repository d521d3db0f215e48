"""The prefix cache's observer: replaying the recorded events rebuilds the cache map's keys exactly."""

from __future__ import annotations

import random

import pytest

from paged_jax.kv_cache import FULL, KVCacheManager, KVGroup
from paged_jax.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventRecorder, KVEventBatch
from paged_jax.kv_cache.hashing import HASH_BYTES

PS = 8
HYBRID = (KVGroup(None, (1,)), KVGroup(16, (0,)))


def cache_index(m: KVCacheManager) -> set[tuple[int, bytes]]:
    """The manager's own hashed-block set as (group, block hash)."""
    out = set()
    for key in m.pool.cached:
        group = 0 if len(key) == HASH_BYTES else int.from_bytes(key[HASH_BYTES:], "little")
        out.add((group, bytes(key[:HASH_BYTES])))
    return out


def replay(index: set[tuple[int, bytes]], batch: KVEventBatch) -> None:
    """What a router's index does with one batch."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            assert event.group_idx is not None
            new = {(event.group_idx, h) for h in event.block_hashes}
            assert not new & index, "a block is reported stored once, when it enters"
            index |= new
        elif isinstance(event, BlockRemoved):
            assert event.group_idx is not None
            gone = {(event.group_idx, h) for h in event.block_hashes}
            assert gone <= index, "only a stored block is reported removed"
            index -= gone
        else:
            assert isinstance(event, AllBlocksCleared)
            index.clear()


def run_workload(m: KVCacheManager, seed: int, steps: int = 300) -> tuple[set, EventRecorder]:
    """Random admits, growth, forks and frees over a small pool (evictions happen), checking the replayed index
    against the manager's after every operation."""
    recorder = EventRecorder(PS, m.groups, lora_lookup=lambda keys: (7, "ad") if "lora:x" in keys else None)
    m.set_observer(recorder)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(8, 33))] for _ in range(4)]
    live: dict[str, list[int]] = {}
    index: set[tuple[int, bytes]] = set()
    for step in range(steps):
        op = rng.random()
        if op < 0.4 or not live:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 17))]
            keys = rng.choice([(), ("salt:a",), ("lora:x",)])
            rid = f"r{step}"
            if m.admit(rid, tokens, len(tokens), keys) is not None:
                live[rid] = tokens
        elif op < 0.7:
            rid = rng.choice(sorted(live))
            tokens = live[rid]
            tokens.extend(rng.randrange(50) for _ in range(rng.randrange(1, 6)))
            if m.allocate_slots(rid, tokens, len(tokens) - m.num_computed_tokens(rid)) is None:
                m.free(rid)
                del live[rid]
        elif op < 0.75:
            parent = rng.choice(sorted(live))
            m.fork(parent, f"f{step}")
            live[f"f{step}"] = list(live[parent])
        else:
            rid = rng.choice(sorted(live))
            m.free(rid)
            del live[rid]
        batch = recorder.take()
        if batch is not None:
            replay(index, batch)
        assert index == cache_index(m)
    return index, recorder


@pytest.mark.parametrize("groups", [(FULL,), HYBRID], ids=["full", "hybrid"])
def test_events_rebuild_the_cache_index_with_evictions(groups):
    m = KVCacheManager(24, PS, groups=groups)
    index, _ = run_workload(m, seed=1)
    assert m.pool.num_evictions > 20  # the workload evicts
    assert index == cache_index(m) and index


def test_stored_event_fields():
    m = KVCacheManager(32, PS, groups=HYBRID)
    recorder = EventRecorder(PS, m.groups, lora_lookup=lambda keys: (7, "ad") if "lora:x" in keys else None)
    m.set_observer(recorder)
    tokens = list(range(20))
    m.admit("a", tokens, 20, ("salt:s", "lora:x"))
    batch = recorder.take()
    assert batch is not None and recorder.take() is None
    full, window = batch.events
    assert isinstance(full, BlockStored) and isinstance(window, BlockStored)
    state = m.requests["a"]
    assert full.block_hashes == state.block_hashes[:2] == window.block_hashes
    assert full.parent_block_hash is None and full.token_ids == tokens[:16] and full.block_size == PS
    assert (full.lora_id, full.lora_name, full.medium) == (7, "ad", "GPU")
    assert full.extra_keys == [("salt:s", "lora:x"), None]
    assert (full.group_idx, full.kv_cache_spec_kind, full.kv_cache_spec_sliding_window) == (0, "full_attention", None)
    spec = (window.group_idx, window.kv_cache_spec_kind, window.kv_cache_spec_sliding_window)
    assert spec == (1, "sliding_window", 16)
    # The next block continues the chain: its parent is the last stored hash, no extra keys.
    tokens += [20, 21, 22, 23]
    m.allocate_slots("a", tokens, 4)
    (more, _) = recorder.take().events
    assert more.parent_block_hash == state.block_hashes[1] and more.token_ids == list(range(16, 24))
    assert more.extra_keys is None


def test_reset_prefix_cache_only_when_idle_and_reported():
    m = KVCacheManager(16, PS)
    recorder = EventRecorder(PS, m.groups)
    m.set_observer(recorder)
    m.admit("a", list(range(17)), 17)
    assert not m.reset_prefix_cache()  # a running request's blocks stay findable
    m.free("a")
    recorder.take()
    assert m.reset_prefix_cache()
    assert [type(e) for e in recorder.take().events] == [AllBlocksCleared]
    assert cache_index(m) == set() and m.lookup_prefix(list(range(17))) == 0
    assert m.num_free_pages() == 15 and m.stats().pages_cached_free == 0
    m.admit("b", list(range(17)), 17)  # the pool works on as before
    assert len(cache_index(m)) == 2
