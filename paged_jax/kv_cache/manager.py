"""The facade the scheduler talks to: per-request block tables, one per KV cache group, on top of the page pool.

The scheduler never touches a ``Page`` record; it speaks in request ids, token counts and page ids. Every
mutating call is all or nothing: it validates, then decides whether enough free pages exist, and only
then moves anything. A call that returns ``None`` (not enough pages) or raises leaves the manager exactly
as it was.

Groups (`paged_jax.kv_cache.groups`): each request has one block table per group, every table of the same
length ``ceil((num_computed + num_draft) / page_size)``, all drawn from the one pool. Only the last block can be
partially filled, and it is the only block a request writes into; a prefix-cache hit always covers whole blocks.
That is why copy-on-write only ever concerns the last block, and only after a ``fork``.

Window-bounded tables: in a group with sliding window ``W`` the query at ``x`` reads keys ``x - W < p <= x``. A
step whose first query is at ``start`` (every later query of the request is further right) can never read a key
below ``start - W + 1``, so the blocks wholly below it leave the group's table before the step allocates: the
entry becomes the null page and the page's reference is dropped. A full block that is prefix-cached stays in the
LRU as an evictable cached page (a later request may still hit it); any other page is free at once. Chunked
prefill drops as it goes, so a window group holds at most ``ceil((W - 1 + chunk) / page_size) + 1`` pages.

Prefix hits across groups: a hit of ``h`` tokens needs, in a full group, every block below ``h``; in a window
group, the blocks covering ``[h - W + 1, h)`` (what the first computed query at ``h`` reads). Each group's cached
pages are its own (the cache key is the block hash plus the group), so the longest ``h`` every group can serve is
found by lowering ``h`` group by group until no group lowers it (a fixed point: a full group's condition holds for
every shorter ``h``, a window group's must be re-checked).

Speculative decoding (``paged_jax.spec_decode``) reserves slots past ``num_computed`` for a step's draft tokens
(``allocate_slots(num_draft=k)``); those slots hold unverified KV until ``accept_drafts`` keeps the accepted
ones and returns the pages only the rejected ones needed. A block is never hashed while it holds a draft.

Full blocks enter the prefix cache as soon as they are scheduled (``admit``/``allocate_slots``), not
after the step ran. This is sound because the step writes every new K/V of a layer into its page before
that layer's attention reads any page, so a request admitted later in the same step that hits such a page
reads KV written in the same pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from paged_jax.kv_cache.groups import FULL, KVGroup
from paged_jax.kv_cache.hashing import HASH_BYTES, BlockHash, BlockHasher
from paged_jax.kv_cache.observer import CacheObserver
from paged_jax.kv_cache.page_bounds import MAX_PAGE_SIZE, MIN_PAGE_SIZE, cdiv
from paged_jax.kv_cache.page_pool import NULL_PAGE, Page, PagePool
from paged_jax.kv_cache.stats import GroupStats, KVCacheStats


class PageCopy(NamedTuple):
    """A copy-on-write instruction: the device copies page `src` to page `dst` (every slab) before the step."""

    src: int
    dst: int


@dataclass(slots=True)
class RequestPages:
    """What the manager knows about one running request."""

    tables: list[list[Page]]
    """One block table per group, logical block i -> physical page ``tables[g][i].page_id``; append-only except
    CoW and a window group's leading blocks, which turn into the null page once no query can read them."""
    num_computed: int
    """Tokens whose KV is (or is being, this step) written into the tables' pages."""
    block_hashes: list[BlockHash]
    """Chained hashes of the request's leading full blocks (may run ahead of ``num_cached_blocks``)."""
    num_cached_blocks: int
    """Blocks ``[0, num_cached_blocks)`` have been offered to the prefix cache (== num_computed // size, but
    while an ``allocate_slots(cache=False)`` awaits its ``cache_blocks``)."""
    extra_keys: tuple[str, ...]
    """The first block's extra hash keys (cache salt, adapter): ``paged_jax.kv_cache.hashing``."""
    dropped: list[int]
    """Per distinct window (the manager's ``windows``): leading blocks dropped from its groups' tables."""
    ids: list[list[int]]
    """``tables`` as page ids (0 for a dropped block), kept in step with every change: what the scheduler hands the
    runner each step is a copy of these lists, not a walk over the tables."""
    drop_at: int = 0
    """The first step start at which some window group drops another block (the decode fast path's test)."""
    num_draft: int = 0
    """Slots past ``num_computed`` written with unverified draft tokens this step (speculative decoding); the
    tables cover them."""
    may_share: bool = False
    """A ``fork`` shared the last block: the next write checks it for copy-on-write."""


class KVCacheManager:
    """Host-side owner of the paged KV cache: which page holds which block of which request, per group."""

    def __init__(
        self,
        num_pages: int,
        page_size: int = 16,
        enable_prefix_caching: bool = True,
        groups: Sequence[KVGroup] = (FULL,),
        max_step_tokens: int | None = None,
    ) -> None:
        """`groups`: the KV cache groups (`paged_jax.kv_cache.groups.kv_layout`), one by default.
        `max_step_tokens`: the most tokens a step computes for one sequence (the scheduler's chunk, drafts
        included), which bounds a window group's pages in `can_ever_fit`; None: a step may compute a whole
        request."""
        if (
            not isinstance(page_size, int)
            or page_size & (page_size - 1)
            or not (MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE)
        ):
            raise ValueError(
                f"page_size must be a power of two in [{MIN_PAGE_SIZE}, {MAX_PAGE_SIZE}], got {page_size!r}"
            )
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"num_pages must be an int >= 2 (page 0 is the null page), got {num_pages!r}")
        if not groups or any(g.window is not None and g.window < 1 for g in groups):
            raise ValueError(f"groups: at least one group, windows >= 1, got {groups!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = tuple(groups)
        self.max_step_tokens = max_step_tokens
        self.pool = PagePool(num_pages, enable_caching=enable_prefix_caching)
        self.hasher = BlockHasher(page_size)
        self.requests: dict[str, RequestPages] = {}
        self._null = self.pool.pages[NULL_PAGE]
        # Distinct windows, and for each the groups that slide by it (their tables drop the same blocks).
        self.windows: tuple[int, ...] = tuple(sorted({g.window for g in groups if g.window is not None}))
        self._window_groups = tuple(tuple(i for i, g in enumerate(groups) if g.window == w) for w in self.windows)
        self._full_groups = tuple(i for i, g in enumerate(groups) if g.window is None)
        # A group's cache key: the block hash, plus the group's index past group 0 (each group caches its own pages).
        self._key_suffix = [b""] + [bytes([i]) if i < 256 else i.to_bytes(4, "little") for i in range(1, len(groups))]
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._group_pages = [0] * len(groups)  # per group: distinct pages its tables hold (refcount > 0)
        self.observer: CacheObserver | None = None

    def set_observer(self, observer: CacheObserver | None) -> None:
        """Report every change of the prefix cache's entries to `observer` (`paged_jax.kv_cache.observer`)."""
        self.observer = observer
        self.pool.on_evict = None if observer is None else self._evicted

    def _evicted(self, key: BlockHash) -> None:
        """A cache key the pool evicted, reported as (group, block hash): keys past group 0 carry a suffix."""
        assert self.observer is not None, "the pool reports evictions only while an observer is set"
        n = HASH_BYTES
        group = 0 if len(key) == n else int.from_bytes(key[n:], "little")
        self.observer.blocks_removed(group, (BlockHash(key[:n]),))

    # ----------------------------------------------------------------------------------------- queries

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def pages_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens in one table: ``ceil(num_tokens / page_size)``."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return cdiv(num_tokens, self.page_size)

    def pages_to_grow(self, num_computed: int, num_tokens: int) -> int:
        """New pages (all groups) a request with ``num_computed`` tokens in its tables takes to hold ``num_tokens``."""
        return self.num_groups * max(0, self.pages_needed(num_tokens) - self.pages_needed(num_computed))

    def peak_pages(self, num_tokens: int) -> int:
        """The most pages (all groups) a request of ``num_tokens`` tokens ever holds at once: every block in a
        full group; in a window group, what one step's queries can read (``max_step_tokens``, module docstring)."""
        blocks = self.pages_needed(num_tokens)
        step = num_tokens if self.max_step_tokens is None else min(num_tokens, self.max_step_tokens)
        total = len(self._full_groups) * blocks
        for window, members in zip(self.windows, self._window_groups, strict=True):
            total += len(members) * min(blocks, cdiv(window - 1 + step, self.page_size) + 1)
        return total

    def num_free_pages(self) -> int:
        """Pages with refcount 0, cached-but-free ones included (they are reclaimed on demand)."""
        return self.pool.free_queue.num_free

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens fits in an otherwise empty pool."""
        return self.peak_pages(num_tokens) <= self.num_pages - 1

    def lookup_prefix(self, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> int:
        """Leading tokens every group can serve from the cache (a multiple of page_size). Pure: changes nothing.

        Capped so that at least the last token is left to compute (its logits are needed). Not counted in
        the stats: the scheduler may look up a waiting request every step until it fits; ``admit`` counts.
        """
        return self._hit_blocks(token_ids, extra_keys, []) * self.page_size

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def page_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's block table of ``group`` as physical page ids (a fresh list; 0: a dropped block)."""
        return list(self._get(request_id).ids[group])

    def block_tables(self, request_id: str) -> list[list[int]]:
        """Every group's block table as physical page ids, in group order (a window group's dropped blocks: 0)."""
        return [list(ids) for ids in self._get(request_id).ids]

    def live_tables(self, request_id: str) -> tuple[list[int], list[list[int]]]:
        """Per group, the first block its table still holds (0 in a full group) and the page ids from there on:
        what a step needs, without the dropped blocks' zeros (fresh lists)."""
        state = self._get(request_id)
        first = self._first_blocks(state.dropped)
        return first, [ids[lo:] for lo, ids in zip(first, state.ids, strict=True)]

    def block_table_row(self, request_id: str, width: int, group: int = 0) -> np.ndarray:
        """The block table of ``group`` as an int32 row of ``width`` entries, padded with the null page."""
        pages = self._get(request_id).tables[group]
        if len(pages) > width:
            raise ValueError(f"request {request_id!r} has {len(pages)} pages, row width is {width}")
        row = np.full(width, NULL_PAGE, dtype=np.int32)
        row[: len(pages)] = [p.page_id for p in pages]
        return row

    def num_computed_tokens(self, request_id: str) -> int:
        """Leading tokens of the request whose KV is in its pages (or is written this step): the one count of
        computed tokens (sequences do not keep their own)."""
        return self._get(request_id).num_computed

    def page_ref_count(self, page_id: int) -> int:
        """Refcount of one physical page (for tests and debugging)."""
        return self.pool.pages[page_id].ref_cnt

    def free_page_ids(self) -> list[int]:
        """Free pages in eviction order, next-evicted first (O(n); for tests and debugging)."""
        return self.pool.free_queue.page_ids()

    def cache_key(self, block_hash: BlockHash, group: int) -> BlockHash:
        """The prefix cache's key of a block of ``group`` (group 0: the block hash itself)."""
        return block_hash if group == 0 else BlockHash(block_hash + self._key_suffix[group])

    def first_readable_block(self, start: int, window: int) -> int:
        """Leading blocks no query at a position >= ``start`` reads under ``window``: keys below
        ``start - window + 1``."""
        return max(0, start - window + 1) // self.page_size

    # ---------------------------------------------------------------------------------------- mutation

    def admit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        extra_keys: tuple[str, ...] = (),
        read_cache: bool = True,
    ) -> int | None:
        """Admit a waiting (new or preempted) request: take its prefix hits, allocate for new tokens.

        ``num_new_tokens`` is the number of tokens to compute this step *beyond the cache hit*; it is
        clipped to ``len(token_ids) - cached``. The hit is re-derived here, so it may differ from an earlier
        ``lookup_prefix`` (pages cached or evicted meanwhile); either way the result is correct: the request
        then has ``num_computed = cached + clipped`` (read it back with ``num_computed_tokens``) and its KV
        for positions ``[0, cached)`` that some group still reads is already in its pages.

        ``read_cache=False`` takes no hits (a request that needs the logits of every prompt token); its full
        blocks are still offered to the cache as they complete.

        Returns ``cached``, or ``None`` with nothing changed when the free pages do not suffice. Raises
        ``ValueError`` for a duplicate id, empty tokens, ``num_new_tokens < 1``, or a request that could
        never fit in the pool.
        """
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already admitted")
        if not token_ids:
            raise ValueError("admit needs at least one token")
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        hashes: list[BlockHash] = []
        num_hits = self._hit_blocks(token_ids, extra_keys, hashes) if read_cache else 0
        cached = num_hits * self.page_size
        total = cached + min(num_new_tokens, len(token_ids) - cached)
        need = self.pages_needed(total)
        dropped = [self.first_readable_block(cached, w) for w in self.windows]
        first = self._first_blocks(dropped)
        live = sum(need - lo for lo in first)
        if live > self.num_pages - 1:
            raise ValueError(f"request {request_id!r} needs {live} pages, the pool has {self.num_pages - 1}")
        lookup = self.pool.cached
        hits = [[lookup[self.cache_key(hashes[i], g)] for i in range(lo, num_hits)] for g, lo in enumerate(first)]
        num_revived = sum(1 for group_hits in hits for b in group_hits if b.ref_cnt == 0)
        if self.num_groups * (need - num_hits) + num_revived > self.pool.free_queue.num_free:
            return None
        # Revive every group's hits first: they leave the free list, so the allocation below cannot evict them.
        for g, group_hits in enumerate(hits):
            for page in group_hits:
                self._group_pages[g] += page.ref_cnt == 0
                self.pool.touch(page)
        tables = []
        for g, (lo, group_hits) in enumerate(zip(first, hits, strict=True)):
            table = [self._null] * lo + group_hits
            table.extend(self.pool.allocate(need - num_hits))
            self._group_pages[g] += need - num_hits
            tables.append(table)
        ids = [[p.page_id for p in table] for table in tables]
        state = RequestPages(tables, total, hashes, num_hits, extra_keys, dropped, ids, self._drop_at(dropped))
        self.requests[request_id] = state
        self._cache_full_blocks(state, token_ids)
        if read_cache:
            self._prefix_queries += len(token_ids)
            self._prefix_hits += cached
        return cached

    def allocate_slots(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens: int, cache: bool = True, num_draft: int = 0
    ) -> list[PageCopy] | None:
        """A running request computes positions ``[num_computed, num_computed + num_new_tokens)`` now.

        Drops the window groups' blocks that no query from ``num_computed`` on can read, then allocates the pages
        this needs in every group, all or nothing (``None``: not enough free pages, nothing changed; the pages the
        drop would free count as free). If the block written first is shared (refcount > 1, after a ``fork``) the
        request gets a private copy in each group and the call returns ``[(src_page, dst_page), ...]``: the device
        must copy src to dst before the step writes. Otherwise returns ``[]``. Newly completed full blocks enter
        the prefix cache, and the request's ``num_computed`` advances by ``num_new_tokens``.

        ``cache=False`` defers the prefix caching: the engine's one-step lookahead schedules a token whose id
        the device has not returned yet (``token_ids`` holds a placeholder there), and calls
        ``cache_blocks`` once the id is known.

        ``num_draft``: slots for that many draft tokens after the new ones (speculative decoding), allocated
        with them but not counted as computed and never hashed; the step's ``accept_drafts`` settles them.
        """
        state = self._get(request_id)
        start = state.num_computed
        total = start + num_new_tokens
        # Fast path (most decode steps): nothing to drop, copy or allocate; every group alike.
        if (
            not num_draft
            and not state.num_draft
            and not state.may_share
            and 0 <= num_new_tokens
            and start < state.drop_at
            and total <= len(state.tables[0]) * self.page_size
            and len(token_ids) >= total
        ):
            state.num_computed = total
            if cache and total // self.page_size > state.num_cached_blocks:
                self._cache_full_blocks(state, token_ids)
            return []
        if num_new_tokens < 0 or num_draft < 0:
            raise ValueError(f"num_new_tokens and num_draft must be >= 0, got {num_new_tokens}, {num_draft}")
        if state.num_draft:
            raise ValueError(f"request {request_id!r}: the previous step's drafts were not settled (accept_drafts)")
        ps = self.page_size
        if len(token_ids) < total:
            raise ValueError(f"request {request_id!r}: {total} tokens to compute, {len(token_ids)} given")
        tables = state.tables
        need = cdiv(total + num_draft, ps)
        num_new_pages = need - len(tables[0])
        # Window drops: which blocks leave, and how many pages that frees.
        drops: list[tuple[int, int]] = []
        gain = 0
        for wi, window in enumerate(self.windows):
            upto = self.first_readable_block(start, window)
            if upto > state.dropped[wi]:
                drops.append((wi, upto))
                for g in self._window_groups[wi]:
                    gain += sum(1 for p in tables[g][state.dropped[wi] : upto] if p.ref_cnt == 1)
        if num_new_pages > 0 and need > self.num_pages - 1:
            dropped = dict(drops)
            first = self._first_blocks([dropped.get(wi, d) for wi, d in enumerate(state.dropped)])
            live = sum(need - lo for lo in first)
            if live > self.num_pages - 1:
                raise ValueError(f"request {request_id!r} needs {live} pages, the pool has {self.num_pages - 1}")
        cow: list[int] = []  # groups whose written block is shared
        writes = num_new_tokens + num_draft > 0
        if state.may_share and writes and start % ps != 0:
            index = start // ps
            cow = [g for g, table in enumerate(tables) if table[index].ref_cnt > 1]
        if self.num_groups * max(0, num_new_pages) + len(cow) > self.pool.free_queue.num_free + gain:
            return None
        for wi, upto in drops:
            self._drop(state, wi, upto)
        copies: list[PageCopy] = []
        for g in cow:
            index = start // ps
            src = tables[g][index]
            dst = self.pool.allocate(1)[0]
            tables[g][index] = dst
            state.ids[g][index] = dst.page_id
            self._group_pages[g] += 1
            self.pool.release(src)  # refcount was > 1: src stays in use by its other holders
            copies.append(PageCopy(src.page_id, dst.page_id))
        if writes:
            state.may_share = False
        if num_new_pages > 0:
            for g, (table, ids) in enumerate(zip(tables, state.ids, strict=True)):
                new = self.pool.allocate(num_new_pages)
                table.extend(new)
                ids.extend([p.page_id for p in new])
                self._group_pages[g] += num_new_pages
        state.num_computed = total
        state.num_draft = num_draft
        if cache and total // ps > state.num_cached_blocks:
            self._cache_full_blocks(state, token_ids)
        return copies

    def accept_drafts(self, request_id: str, num_accepted: int, token_ids: Sequence[int]) -> None:
        """Settle the drafts of the last ``allocate_slots``: the first ``num_accepted`` become computed tokens
        (``token_ids`` holds them now), the rest are rolled back. Pages only the rejected drafts needed go back
        to the free list; the blocks the accepted ones completed enter the prefix cache."""
        state = self._get(request_id)
        if not 0 <= num_accepted <= state.num_draft:
            raise ValueError(f"request {request_id!r}: {num_accepted} drafts accepted of {state.num_draft}")
        computed = state.num_computed + num_accepted
        if len(token_ids) < computed:
            raise ValueError(f"request {request_id!r}: {computed} tokens computed, {len(token_ids)} given")
        state.num_computed, state.num_draft = computed, 0
        keep = cdiv(computed, self.page_size)
        for g, (table, ids) in enumerate(zip(state.tables, state.ids, strict=True)):
            while len(table) > keep:  # fresh pages of this step: refcount 1, never hashed
                self._release(table.pop(), g)
                ids.pop()
        self._cache_full_blocks(state, token_ids)

    def num_draft_slots(self, request_id: str) -> int:
        """Draft slots reserved by the last ``allocate_slots`` and not yet settled."""
        return self._get(request_id).num_draft

    def cache_blocks(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Offer the request's full blocks not yet cached to the prefix cache (see ``allocate_slots``)."""
        state = self._get(request_id)
        if len(token_ids) < state.num_computed:
            raise ValueError(f"request {request_id!r}: {state.num_computed} tokens computed, {len(token_ids)} given")
        self._cache_full_blocks(state, token_ids)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every page of the parent (refcount +1 each); writes later copy on write."""
        parent = self._get(parent_id)
        if parent.num_draft:
            raise ValueError(f"fork of {parent_id!r} while it holds unsettled drafts")
        if child_id in self.requests:
            raise ValueError(f"fork target {child_id!r} already exists")
        null = self._null
        for table in parent.tables:
            for page in table:
                if page is not null:
                    self.pool.touch(page)
        parent.may_share = True
        self.requests[child_id] = RequestPages(
            [list(table) for table in parent.tables],
            parent.num_computed,
            list(parent.block_hashes),
            parent.num_cached_blocks,
            parent.extra_keys,
            list(parent.dropped),
            [list(ids) for ids in parent.ids],
            parent.drop_at,
            may_share=True,
        )

    def free(self, request_id: str) -> None:
        """Release a finished, aborted or preempted request's pages; raises ``KeyError`` if unknown.

        Pages go back tail first, so among one request's cached pages the one ending the longest prefix
        is evicted first and the shared leading blocks last. Full blocks stay cached, so a preempted
        request recomputed later mostly hits the prefix cache.
        """
        state = self._get(request_id)
        del self.requests[request_id]
        null = self._null
        tables = state.tables
        for i in range(len(tables[0]) - 1, -1, -1):
            for g, table in enumerate(tables):
                page = table[i]
                if page is not null:
                    self._release(page, g)

    def reset_prefix_cache(self) -> bool:
        """Drop every prefix-cache entry (as vLLM's `reset_prefix_cache`): only while no request holds pages, since a
        running request's blocks must stay findable by the requests that share them. Returns whether it did."""
        if self.requests:
            return False
        self.pool.clear_cache()
        if self.observer is not None:
            self.observer.cleared()
        return True

    # ----------------------------------------------------------------------------------- introspection

    def stats(self) -> KVCacheStats:
        """A snapshot; O(requests x groups).

        Token slots: every page in use is full but some request's partial last block (its holders agree on the
        fill), and in a window group the first live page of a table may start below the window's reach: those
        slots count as unreadable once per page (the fewest any holder leaves unread; a page that is another
        holder's inner, wholly read page then counts too low, so `kv_utilization` is a lower bound with sharing).
        """
        ps = self.page_size
        pool = self.pool
        total = self.num_pages - 1
        in_use = total - pool.free_queue.num_free
        empty: dict[int, int] = {}  # partial last page -> its empty slots
        unread: dict[int, int] = {}  # a window table's first live page -> slots below the reach (min over holders)
        group_empty = [0] * self.num_groups
        group_unread = [0] * self.num_groups
        for state in self.requests.values():
            written = state.num_computed + state.num_draft
            fill = written % ps
            for g, (group, ids) in enumerate(zip(self.groups, state.ids, strict=True)):
                if fill and ids and ids[-1] not in empty:
                    empty[ids[-1]] = ps - fill
                    group_empty[g] += ps - fill
                if group.window is None:
                    continue
                lo_tok = max(0, state.num_computed - group.window + 1)
                first = lo_tok // ps
                if first < len(ids) and ids[first] != NULL_PAGE and lo_tok % ps:
                    pid, n = ids[first], lo_tok % ps
                    if n < unread.get(pid, ps + 1):
                        group_unread[g] += n - unread.get(pid, 0)
                        unread[pid] = n
        slot_util = (in_use * ps - sum(empty.values())) / (in_use * ps) if in_use else 1.0
        layers = [len(group.layers) or 1 for group in self.groups]
        slabs = max(layers)
        readable = sum(
            layers[g] * (self._group_pages[g] * ps - group_empty[g] - group_unread[g]) for g in range(self.num_groups)
        )
        queries, hits = self._prefix_queries, self._prefix_hits
        return KVCacheStats(
            pages_total=total,
            pages_free=pool.free_queue.num_free,
            pages_cached_free=pool.num_cached_free,
            pages_in_use=in_use,
            slot_utilization=slot_util,
            kv_utilization=readable / (in_use * ps * slabs) if in_use else 1.0,
            prefix_queries=queries,
            prefix_hits=hits,
            prefix_hit_rate=hits / queries if queries else 0.0,
            evictions=pool.num_evictions,
            groups=tuple(
                GroupStats(group.window, len(group.layers), self._group_pages[g]) for g, group in enumerate(self.groups)
            ),
        )

    # ---------------------------------------------------------------------------------------- internal

    def _get(self, request_id: str) -> RequestPages:
        state = self.requests.get(request_id)
        if state is None:
            raise KeyError(f"unknown request {request_id!r}")
        return state

    def _first_blocks(self, dropped: Sequence[int]) -> list[int]:
        """Per group, its first live block given each window's dropped count (0 for a full group)."""
        first = [0] * self.num_groups
        for wi, members in enumerate(self._window_groups):
            for g in members:
                first[g] = dropped[wi]
        return first

    def _drop(self, state: RequestPages, wi: int, upto: int) -> None:
        """Window ``wi``'s groups' blocks ``[dropped, upto)`` leave their tables (oldest first, so among cached
        ones the oldest is evicted first)."""
        null, release = self._null, self._release
        for g in self._window_groups[wi]:
            table, ids = state.tables[g], state.ids[g]
            for i in range(state.dropped[wi], upto):
                page = table[i]
                if page is not null:
                    table[i] = null
                    ids[i] = NULL_PAGE
                    release(page, g)
        state.dropped[wi] = upto
        state.drop_at = self._drop_at(state.dropped)

    def _release(self, page: Page, group: int) -> None:
        """Drop one reference of a page of ``group``; the group's count of pages loses it at refcount 0."""
        self.pool.release(page)
        if page.ref_cnt == 0:
            self._group_pages[group] -= 1

    def _drop_at(self, dropped: Sequence[int]) -> int:
        """The smallest step start at which a window drops its next block (its keys all below start - W + 1)."""
        ps = self.page_size
        return min(((d + 1) * ps + w - 1 for d, w in zip(dropped, self.windows, strict=True)), default=1 << 62)

    def _hit_blocks(self, token_ids: Sequence[int], extra_keys: tuple[str, ...], hashes: list[BlockHash]) -> int:
        """Leading full blocks every group can serve from the cache (module docstring); fills ``hashes`` on the way.

        At most ``(len - 1) // page_size`` blocks, so the last token is always left to compute.
        """
        if not self.enable_prefix_caching:
            return 0
        cached = self.pool.cached
        h = (len(token_ids) - 1) // self.page_size
        for g in self._full_groups:
            i = 0
            while i < h:
                self.hasher.extend(hashes, token_ids, i + 1, extra_keys)
                if self.cache_key(hashes[i], g) not in cached:
                    break
                i += 1
            h = i
        if not self.windows or h == 0:
            return h
        self.hasher.extend(hashes, token_ids, h, extra_keys)
        while True:
            before = h
            for window, members in zip(self.windows, self._window_groups, strict=True):
                for g in members:
                    h = self._window_hit(g, window, h, hashes)
            if h == before:
                return h

    def _window_hit(self, group: int, window: int, h: int, hashes: list[BlockHash]) -> int:
        """The largest ``h2 <= h`` (blocks) whose blocks ``[first_readable_block(h2 * page_size), h2)`` are all
        cached in ``group``; 0 always qualifies (no hit)."""
        cached, ps = self.pool.cached, self.page_size
        while h > 0:
            lo = self.first_readable_block(h * ps, window)
            miss = next((i for i in range(h - 1, lo - 1, -1) if self.cache_key(hashes[i], group) not in cached), None)
            if miss is None:
                return h
            h = miss
        return 0

    def _cache_full_blocks(self, state: RequestPages, token_ids: Sequence[int]) -> None:
        """Offer the request's newly completed full blocks (in every group still holding them) to the cache."""
        num_full = state.num_computed // self.page_size
        if num_full <= state.num_cached_blocks:
            return
        if self.enable_prefix_caching:
            self.hasher.extend(state.block_hashes, token_ids, num_full, state.extra_keys)
            null, observer = self._null, self.observer
            for g, table in enumerate(state.tables):
                run = state.num_cached_blocks  # the first block of the run of new entries being reported
                for i in range(state.num_cached_blocks, num_full):
                    page = table[i]
                    new = page is not null and page.block_hash is None
                    if page is not null:
                        new = self.pool.cache(page, self.cache_key(state.block_hashes[i], g)) and new
                    if observer is not None and not new:
                        self._report_stored(state, token_ids, g, run, i)
                        run = i + 1
                if observer is not None:
                    self._report_stored(state, token_ids, g, run, num_full)
        state.num_cached_blocks = num_full

    def _report_stored(self, state: RequestPages, token_ids: Sequence[int], group: int, lo: int, hi: int) -> None:
        """Tell the observer that blocks ``[lo, hi)`` of ``state`` became entries of ``group`` (nothing if empty)."""
        if hi <= lo or self.observer is None:
            return
        ps = self.page_size
        self.observer.blocks_stored(
            group,
            state.block_hashes[lo:hi],
            state.block_hashes[lo - 1] if lo else None,
            token_ids[lo * ps : hi * ps],
            state.extra_keys,
        )
