"""The page pool: one ``Page`` record per physical page, refcounts, the LRU free list and the prefix-cache map.

Names: a *page* is the physical unit (a slab of the device KV array, named by its ``page_id``); a *block* is
a logical unit of a request's tokens (block ``i`` holds tokens ``[i * page_size, (i + 1) * page_size)``), and a
block table maps a request's blocks to the pages holding them. Block hashes name a block's tokens; a full
page carries the hash of the block it holds.

All ``Page`` objects are created once, at start-up. The free list is intrusive (the links live in the
pages themselves) and doubly linked between two sentinels, so taking a page out of its middle (a
prefix-cache hit on a free page) is O(1) and neither allocation nor freeing creates Python objects per
page. Page 0 is the null page that padding slots point at: it is never in the free list and never
handed out.

A page is in exactly one of three states:
  * in use:        ``ref_cnt > 0``, not in the free list, maybe cached (a full block, with its hash);
  * cached, free:  ``ref_cnt == 0``, in the free list, carries a hash that the cache map points back at;
  * plain free:    ``ref_cnt == 0``, in the free list, no hash.
Eviction is lazy: a cached free page keeps its hash (and stays findable) until the free list hands it out
again; only then is its hash entry removed, so no entry can ever point at a reused page.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from paged_jax.kv_cache.hashing import BlockHash

NULL_PAGE = 0


@dataclass(slots=True, eq=False)
class Page:
    """Host-side metadata of one physical page (identity matters: never compared by value)."""

    page_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    """Set only while the page is the prefix cache's entry for this hash."""
    prev_free: Page | None = None
    next_free: Page | None = None

    def __repr__(self) -> str:
        return f"Page({self.page_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreePageQueue:
    """Intrusive doubly linked list of free pages in eviction order: head is evicted first.

    Every operation is O(1) and allocates nothing. A page is in the list iff its ``prev_free`` is set
    (sentinels make every real node have both neighbours).
    """

    __slots__ = ("head", "tail", "num_free")

    def __init__(self, pages: list[Page]) -> None:
        self.head = Page(-1)
        self.tail = Page(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free = 0
        for page in pages:
            self.append(page)

    def popleft(self) -> Page:
        """Remove and return the page at the head (the least recently freed, or a hash-less one)."""
        page = self.head.next_free
        if page is self.tail or page is None:
            raise RuntimeError("free list is empty")
        self.remove(page)
        return page

    def remove(self, page: Page) -> None:
        """Unlink ``page`` from anywhere in the list."""
        prev, nxt = page.prev_free, page.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"page {page.page_id} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        page.prev_free = page.next_free = None
        self.num_free -= 1

    def append(self, page: Page) -> None:
        """Insert at the tail: evicted last."""
        last = self.tail.prev_free
        assert last is not None, "the tail sentinel always has a predecessor"
        page.prev_free, page.next_free = last, self.tail
        last.next_free = page
        self.tail.prev_free = page
        self.num_free += 1

    def appendleft(self, page: Page) -> None:
        """Insert at the head: evicted first (used for pages that hold nothing reusable)."""
        first = self.head.next_free
        assert first is not None, "the head sentinel always has a successor"
        page.prev_free, page.next_free = self.head, first
        first.prev_free = page
        self.head.next_free = page
        self.num_free += 1

    def page_ids(self) -> list[int]:
        """Free pages head to tail (O(n); for tests and invariant checks)."""
        out: list[int] = []
        node = self.head.next_free
        while node is not self.tail:
            assert node is not None, "the list ends at the tail sentinel"
            out.append(node.page_id)
            node = node.next_free
        return out


class PagePool:
    """Owns every page: hands out fresh pages, revives cached ones, takes them back, evicts lazily."""

    __slots__ = ("pages", "free_queue", "cached", "num_cached_free", "num_evictions", "enable_caching", "on_evict")

    def __init__(self, num_pages: int, enable_caching: bool = True) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.pages = [Page(i) for i in range(num_pages)]
        self.free_queue = FreePageQueue(self.pages[1:])
        self.cached: dict[BlockHash, Page] = {}
        self.num_cached_free = 0
        self.num_evictions = 0
        self.enable_caching = enable_caching
        # Told (hash, page id) when a cached page is evicted, before it is handed out (the host tier copies it; the
        # KV events observer reports it: `paged_jax.kv_cache.observer`).
        self.on_evict: Callable[[BlockHash, int], None] | None = None

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def lookup(self, block_hash: BlockHash) -> Page | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[Page]:
        """Take ``n`` pages from the head of the free list, evicting their hashes; refcount 1 each.

        The caller has checked ``n <= num_free`` (all or nothing is decided before anything moves).
        """
        if n > self.free_queue.num_free:
            raise RuntimeError(f"allocate({n}) with only {self.free_queue.num_free} free pages")
        out = []
        queue = self.free_queue
        head, tail = queue.head, queue.tail
        node = head.next_free
        for _ in range(n):  # unlink n pages from the head in one walk (FreePageQueue.popleft, inlined)
            assert node is not None and node is not tail, "n <= num_free was checked"
            page, node = node, node.next_free
            page.prev_free = page.next_free = None
            if page.block_hash is not None:
                del self.cached[page.block_hash]
                if self.on_evict is not None:
                    self.on_evict(page.block_hash, page.page_id)
                page.block_hash = None
                self.num_cached_free -= 1
                self.num_evictions += 1
            page.ref_cnt = 1
            out.append(page)
        head.next_free = node
        assert node is not None
        node.prev_free = head
        queue.num_free -= n
        return out

    def touch(self, page: Page) -> None:
        """Add a reference to a page found in the cache (or shared by a fork); revive it if free."""
        if page.ref_cnt == 0:
            self.free_queue.remove(page)
            if page.block_hash is not None:
                self.num_cached_free -= 1
        page.ref_cnt += 1

    def release_page(self, page: Page) -> bool:
        """Drop one reference; returns whether the page became free (refcount 0): then it joins the free list.

        A cached page goes to the tail (evicted last, in LRU order). A page without a hash holds nothing
        anyone can find again, so it goes to the head and is reused first. (The list links are written here, not
        through ``FreePageQueue``'s methods: this is the hottest call of a window group's drops.)
        """
        ref = page.ref_cnt - 1
        if ref < 0:
            raise RuntimeError(f"release of page {page.page_id} with refcount {page.ref_cnt}")
        page.ref_cnt = ref
        if ref:
            return False
        queue = self.free_queue
        if page.block_hash is not None:
            tail = queue.tail
            last = tail.prev_free
            assert last is not None, "the tail sentinel always has a predecessor"
            page.prev_free, page.next_free = last, tail
            last.next_free = tail.prev_free = page
            self.num_cached_free += 1
        else:
            head = queue.head
            first = head.next_free
            assert first is not None, "the head sentinel always has a successor"
            page.prev_free, page.next_free = head, first
            first.prev_free = head.next_free = page
        queue.num_free += 1
        return True

    def cache(self, page: Page, block_hash: BlockHash) -> bool:
        """Make ``page`` (in use, full) the cache entry for ``block_hash``.

        Returns False and leaves ``page`` uncached when another page already holds this hash: two
        requests that completed identical blocks in the same step keep their own pages, and the map
        points at exactly one of them (the first), so the table can never be corrupted.
        """
        if not self.enable_caching:
            return False
        existing = self.cached.get(block_hash)
        if existing is not None:
            return existing is page
        if page.block_hash is not None:
            raise RuntimeError(f"page {page.page_id} is already cached under another hash")
        page.block_hash = block_hash
        self.cached[block_hash] = page
        return True

    def clear_cache(self) -> None:
        """Drop every cache entry; the pages keep their places in the free list (all must be free: the caller
        checks that no request holds a page)."""
        for page in self.cached.values():
            if page.ref_cnt:
                raise RuntimeError(f"clear_cache with page {page.page_id} in use")
            page.block_hash = None
        self.cached.clear()
        self.num_cached_free = 0
