"""The page pool against a plain reference: a Python list as the free list (head first), a dict of refcounts, a dict
of cache entries. Random operations (allocate several pages in one walk, touch, release, cache, clear) must leave the
pool's intrusive list, counters and map exactly as the reference's, and `release_page` must say when a page becomes
free."""

from __future__ import annotations

import random

import pytest

from paged_jax.kv_cache.hashing import BlockHash
from paged_jax.kv_cache.page_pool import PagePool


class ReferencePool:
    def __init__(self, num_pages: int) -> None:
        self.free = list(range(1, num_pages))  # head first
        self.ref = [0] * num_pages
        self.hash: dict[int, BlockHash] = {}
        self.cached: dict[BlockHash, int] = {}
        self.evicted: list[tuple[BlockHash, int]] = []

    def allocate(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        for pid in out:
            if pid in self.hash:
                key = self.hash.pop(pid)
                del self.cached[key]
                self.evicted.append((key, pid))
            self.ref[pid] = 1
        return out

    def touch(self, pid: int) -> None:
        if self.ref[pid] == 0:
            self.free.remove(pid)
        self.ref[pid] += 1

    def release(self, pid: int) -> bool:
        self.ref[pid] -= 1
        if self.ref[pid]:
            return False
        if pid in self.hash:
            self.free.append(pid)
        else:
            self.free.insert(0, pid)
        return True

    def cache(self, pid: int, key: BlockHash) -> bool:
        if key in self.cached:
            return self.cached[key] == pid
        self.hash[pid], self.cached[key] = key, pid
        return True


def check_same(pool: PagePool, ref: ReferencePool) -> None:
    assert pool.free_queue.page_ids() == ref.free
    assert pool.num_free == len(ref.free)
    assert [p.ref_cnt for p in pool.pages] == ref.ref
    assert {k: p.page_id for k, p in pool.cached.items()} == ref.cached
    assert pool.num_cached_free == sum(1 for pid in ref.free if pid in ref.hash)
    # the links agree backwards too
    back, node = [], pool.free_queue.tail.prev_free
    while node is not pool.free_queue.head:
        assert node is not None
        back.append(node.page_id)
        node = node.prev_free
    assert back[::-1] == ref.free


@pytest.mark.parametrize("seed", range(4))
def test_pool_equals_the_reference_under_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    num_pages = 24
    pool, ref = PagePool(num_pages), ReferencePool(num_pages)
    evicted: list[tuple[BlockHash, int]] = []
    pool.on_evict = lambda key, pid: evicted.append((key, pid))
    held: list[int] = []  # one entry per reference held
    keys = [BlockHash(bytes([i]) * 16) for i in range(12)]
    for _ in range(1500):
        op = rng.random()
        if op < 0.3 and ref.free:
            n = rng.randint(1, min(7, len(ref.free)))
            got = [p.page_id for p in pool.allocate(n)]
            assert got == ref.allocate(n)
            held += got
        elif op < 0.4 and ref.cached:
            pid = ref.cached[rng.choice(list(ref.cached))]
            pool.touch(pool.pages[pid])
            ref.touch(pid)
            held.append(pid)
        elif op < 0.75 and held:
            pid = held.pop(rng.randrange(len(held)))
            assert pool.release_page(pool.pages[pid]) is ref.release(pid)
        elif op < 0.97 and held:
            pid, key = rng.choice(held), rng.choice(keys)
            if pool.pages[pid].block_hash is None or pool.cached.get(key) is pool.pages[pid]:
                assert pool.cache(pool.pages[pid], key) is ref.cache(pid, key)
        elif not held:
            pool.clear_cache()
            ref.hash.clear()
            ref.cached.clear()
        check_same(pool, ref)
        assert evicted == ref.evicted
    assert pool.num_evictions == len(ref.evicted) > 0


def test_release_page_refuses_a_free_page_and_allocate_more_than_free() -> None:
    pool = PagePool(4)
    (page,) = pool.allocate(1)
    assert pool.release_page(page) is True
    with pytest.raises(RuntimeError, match="refcount 0"):
        pool.release_page(page)
    with pytest.raises(RuntimeError, match="allocate\\(4\\) with only 3 free"):
        pool.allocate(4)
    assert pool.free_queue.page_ids() == [1, 2, 3]
