"""The prefix cache's observer: replaying the recorded events rebuilds the cache map's keys exactly (and, with a
host tier and a disk tier, the tiers' keys too)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from paged_jax.kv_cache import FULL, BlockHash, DiskTier, HostTier, KVCacheManager, KVGroup, SwapCosts, SwapSpace
from paged_jax.kv_cache.disk_tier import encode
from paged_jax.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventRecorder, KVEventBatch
from paged_jax.kv_cache.hashing import HASH_BYTES, BlockHasher
from paged_jax.kv_cache.tier_events import split_cache_key

PS = 8
HYBRID = (KVGroup(None, (1,)), KVGroup(16, (0,)))
FREE_COPIES = SwapCosts(copy_bytes_per_s=1e30, flops_per_s=1.0, flops_per_token=1.0, attention_flops=0.0, page_bytes=1)


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


def tier_sets(m: KVCacheManager) -> dict[str, set[tuple[int, bytes]]]:
    """The manager's own block sets per medium: the device cache map's and the host tier's keys."""
    assert m.host_tier is not None
    host = {(g, bytes(h)) for g, h in map(split_cache_key, m.host_tier.entries)}
    return {"GPU": cache_index(m), "CPU": host}


def replay_tiers(index: dict[str, set[tuple[int, bytes]]], batch: KVEventBatch, hasher: BlockHasher) -> None:
    """A consumer keeping both tiers' block sets; every stored block's hash is recomputed from the event's parent
    hash, tokens and extra keys (what a router keying its index by tokens relies on)."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            held = index[event.medium]
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):
                keys = event.extra_keys[i] if event.extra_keys and event.extra_keys[i] else ()
                tokens = event.token_ids[i * PS : (i + 1) * PS]
                assert hasher.hash_block(parent, tokens, keys) == h, "stored blocks carry their parent and tokens"
                assert (event.group_idx, h) not in held, "a block is reported stored once per tier"
                held.add((event.group_idx, h))
                parent = h
        elif isinstance(event, BlockRemoved):
            gone = {(event.group_idx, h) for h in event.block_hashes}
            assert gone <= index[event.medium], "only a stored block is reported removed"
            index[event.medium] -= gone
        else:
            for held in index.values():
                held.clear()


@pytest.mark.parametrize("groups", [(FULL,), HYBRID], ids=["full", "hybrid"])
def test_events_rebuild_both_tiers_through_demotions_restores_and_a_reset(groups):
    """Prompts over shared prefixes on a pool far smaller than them, with a host tier smaller than them too:
    blocks are demoted (GPU removed, CPU stored), restored (GPU stored, still CPU: the tier is inclusive) and
    dropped by the tier (CPU removed); an idle reset clears the device and re-stores the tier's blocks. After every
    step the consumer's two sets equal the manager's device cache map and the tier's entries."""
    m = KVCacheManager(24, PS, groups=groups, host_tier=HostTier(14))
    recorder = EventRecorder(PS, m.groups, lora_lookup=lambda keys: (7, "ad") if "lora:x" in keys else None)
    m.set_observer(recorder)
    hasher = BlockHasher(PS)
    rng = random.Random(3)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(16, 41))] for _ in range(6)]
    index: dict[str, set[tuple[int, bytes]]] = {"GPU": set(), "CPU": set()}
    live: list[str] = []
    media: dict[str, int] = {"GPU": 0, "CPU": 0}
    for step in range(240):
        if step == 160:  # idle, then reset: the device is cleared, the tier's blocks are stored again
            for rid in live:
                m.free(rid)
            live.clear()
            assert m.reset_prefix_cache()
        elif live and (len(live) > 2 or rng.random() < 0.3):
            m.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            keys = rng.choice([(), ("lora:x",)])
            if m.admit(f"r{step}", tokens, len(tokens), keys) is not None:
                live.append(f"r{step}")
        m.take_transfers()  # the step's copies: its offloads become restorable for the next one
        batch = recorder.take()
        if batch is not None:
            for event in batch.events:
                if not isinstance(event, AllBlocksCleared):
                    media[event.medium] += 1
            replay_tiers(index, batch, hasher)
        assert index == tier_sets(m), f"step {step}"
        m.host_tier.check()
        origins = m._tier_reporter.origins  # what it keeps: exactly the blocks either tier holds
        assert origins.keys() == m.pool.cached.keys() | m.host_tier.entries.keys()
    stats = m.host_tier.stats()
    assert stats.offloads > 20 and stats.hits > 5 and stats.evictions > 5  # demoted, restored, dropped
    assert media["CPU"] > 20 and index["CPU"] and index["GPU"]


def test_a_swapped_in_request_reports_its_blocks_cached_again():
    """A swapped-out request whose cached blocks the device evicted meanwhile caches them again when it swaps
    in: reported stored on the device, so the consumer's sets stay the manager's."""
    tier = HostTier(12)
    m = KVCacheManager(8, PS, host_tier=tier)
    swap = SwapSpace(m, tier, FREE_COPIES, "swap")
    recorder = EventRecorder(PS, m.groups)
    m.set_observer(recorder)
    hasher = BlockHasher(PS)
    index: dict[str, set[tuple[int, bytes]]] = {"GPU": set(), "CPU": set()}

    def step() -> None:
        m.take_transfers()
        batch = recorder.take()
        if batch is not None:
            replay_tiers(index, batch, hasher)
        assert index == tier_sets(m)

    a = list(range(100, 100 + 2 * PS + 3))
    m.admit("a", a, len(a))
    step()
    assert swap.swap_out("a")
    swap.end_step(runs=True)
    step()
    b = list(range(300, 300 + 7 * PS))  # every page: a's cached blocks are evicted (and demoted)
    m.admit("b", b, len(b))
    step()
    m.free("b")
    assert swap.swap_in("a", a)
    step()
    assert {h for _, h in index["GPU"]} >= set(m.requests["a"].block_hashes[:2])


DISK_LAYOUT = [((2, 8), np.dtype(np.float32))]  # one stand-in page per block (the worker's copy is not run here)


def disk_sets(m: KVCacheManager) -> dict[str, set[tuple[int, bytes]]]:
    """The manager's block sets per medium with a disk tier: the device's, the host tier's and the disk's files."""
    assert m.host_tier is not None and m.host_tier.disk is not None
    files = {(g, bytes(h)) for g, h in map(split_cache_key, m.host_tier.disk.files)}
    return {**tier_sets(m), "STORAGE": files}


def run_disk_step(m: KVCacheManager, recorder: EventRecorder, index: dict, hasher: BlockHasher) -> None:
    """One step's copies as the worker runs them (every offload and persist written to the disk tier, here a
    stand-in page), the writer thread finished, then the step's events collected and replayed."""
    transfers = m.take_transfers()
    disk = m.host_tier.disk
    for copy in [] if transfers is None else transfers.offloads + transfers.persists:
        if copy.key:
            disk.put(BlockHash(copy.key), [np.full((2, 8), len(disk.files), np.float32)])
    disk.flush()
    m.poll_disk_tier()
    batch = recorder.take()
    if batch is not None:
        replay_tiers(index, batch, hasher)


def test_events_rebuild_the_disk_tier_through_writes_evictions_a_reset_and_a_restart(tmp_path):
    """With a disk tier behind the host tier, the stream tells its files as medium STORAGE (vLLM's name): a file
    is stored once written, removed when the size bound evicts it, and stored again after a reset (the files
    stay); every stored block carries its parent hash and tokens. After every step the consumer's three sets
    equal the device map, the tier's entries and the disk's files. A restarted manager over the same directory
    reports a file found there the first time a prompt's blocks name it (a file keeps no tokens)."""
    one_file = len(encode("fp", BlockHash(bytes(16)), [np.zeros((2, 8), np.float32)]))
    disk = DiskTier(tmp_path, "fp", max_bytes=30 * one_file)
    disk.bind(DISK_LAYOUT)
    m = KVCacheManager(16, PS, host_tier=HostTier(6, disk))
    recorder = EventRecorder(PS, m.groups)
    m.set_observer(recorder)
    hasher = BlockHasher(PS)
    rng = random.Random(5)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(16, 41))] for _ in range(8)]
    index: dict[str, set[tuple[int, bytes]]] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
    live: list[str] = []
    for step in range(200):
        if step == 120:
            for rid in live:
                m.free(rid)
            live.clear()
            assert m.reset_prefix_cache()
        elif live and (len(live) > 1 or rng.random() < 0.3):
            m.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            if m.admit(f"r{step}", tokens, len(tokens)) is not None:
                live.append(f"r{step}")
        run_disk_step(m, recorder, index, hasher)
        assert index == disk_sets(m), f"step {step}"
        reporter = m._tier_reporter
        assert reporter.on_disk == disk.files.keys()
        assert reporter.origins.keys() == m.pool.cached.keys() | m.host_tier.entries.keys() | disk.files.keys()
    assert disk.evictions > 5 and disk.stats().hits > 0  # files evicted by the bound, and read back
    disk.close()

    restarted = DiskTier(tmp_path, "fp", max_bytes=30 * one_file)
    restarted.bind(DISK_LAYOUT)
    m2 = KVCacheManager(16, PS, host_tier=HostTier(6, restarted))
    recorder2 = EventRecorder(PS, m2.groups)
    m2.set_observer(recorder2)
    index2: dict[str, set[tuple[int, bytes]]] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
    found = set(restarted.files)
    named = next(p for p in prefixes if m2.lookup_prefix(p + [0]) >= 2 * PS)  # a prompt whose blocks are on disk
    assert m2.admit("again", named + [0], len(named) + 1) is not None
    run_disk_step(m2, recorder2, index2, hasher)
    assert index2["STORAGE"] and index2["STORAGE"] <= {(0, bytes(k)) for k in found}
    assert {(0, bytes(h)) for h in m2.requests["again"].block_hashes[:2]} <= index2["STORAGE"] & index2["GPU"]
    assert m2._tier_reporter.on_disk == {BlockHash(h) for _, h in index2["STORAGE"]}
    restarted.close()
