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

Persistent block tables (``paged_jax.kv_cache.block_table``): each request also holds a row of one numpy array that
mirrors its tables as page ids; every change above writes there too (a page crossing takes every group's pages in
one pool call and writes them as one column), and ``step_tables`` gathers a step's rows in one copy.

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
from typing import NamedTuple, cast

import numpy as np

from paged_jax.kv_cache.block_table import BlockTables
from paged_jax.kv_cache.groups import FULL, KVGroup
from paged_jax.kv_cache.hashing import BlockHash, BlockHasher
from paged_jax.kv_cache.host_tier import HostTier, KVTransfers
from paged_jax.kv_cache.observer import CacheObserver
from paged_jax.kv_cache.page_bounds import MAX_PAGE_SIZE, MIN_PAGE_SIZE, cdiv
from paged_jax.kv_cache.page_pool import NULL_PAGE, Page, PagePool
from paged_jax.kv_cache.state_snapshots import StateSnapshots
from paged_jax.kv_cache.stats import GroupStats, KVCacheStats
from paged_jax.kv_cache.tier_events import TierReporter, split_cache_key


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
    row: int
    """The request's row of the manager's persistent ``BlockTables`` (``tables`` as page ids, 0 for a dropped
    block), written where ``tables`` change: what a step hands the runner is gathered from there."""
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
        host_tier: HostTier | None = None,
        snapshots: StateSnapshots | None = None,
    ) -> None:
        """`snapshots`: a linear-attention hybrid's state snapshots (`paged_jax.kv_cache.state_snapshots`): a hit
        is lowered to the deepest point with a snapshot, and a snapshot leaves with its block's page.
        `groups`: the KV cache groups (`paged_jax.kv_cache.groups.kv_layout`), one by default.
        `host_tier`: where evicted full blocks go and prefix hits the device misses come from
        (`paged_jax.kv_cache.host_tier`); None: an evicted block is forgotten.
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
        self.block_tables_array = BlockTables(len(groups))
        # Each window's groups are consecutive (`kv_layout` orders groups by window): rows [g0, g1) of the tables.
        self._window_group_span = [(members[0], members[-1] + 1) for members in self._window_groups]
        if any(
            list(members) != list(range(g0, g1))
            for members, (g0, g1) in zip(self._window_groups, self._window_group_span, strict=True)
        ):
            raise ValueError(f"groups: the groups of one window must be consecutive, got {groups!r}")
        self.host_tier = host_tier if enable_prefix_caching else None
        self._prefix_hits_host = 0  # of the hits, tokens of blocks some group restored from the host tier
        self._known: _Known | dict[BlockHash, Page] = self.pool.cached  # what a prefix lookup can hit
        self.observer: CacheObserver | None = None
        self._tier_reporter: TierReporter | None = None  # the host tier's events, with an observer and a tier
        self.snapshots = snapshots if enable_prefix_caching else None
        if self.snapshots is not None:
            self.pool.on_evict = self._evicted
        if self.host_tier is not None:
            self.pool.on_evict = self._evicted
            self._known = _Known(self.pool.cached, self.host_tier)

    def set_observer(self, observer: CacheObserver | None) -> None:
        """Report every change of the prefix cache's entries to `observer` (`paged_jax.kv_cache.observer`)."""
        self.observer = observer
        idle = observer is None and self.host_tier is None and self.snapshots is None
        self.pool.on_evict = None if idle else self._evicted
        if self.host_tier is not None:
            tier = self.host_tier
            self._tier_reporter = None if observer is None else TierReporter(observer, tier, self.pool.cached)
            tier.on_change = None if self._tier_reporter is None else self._tier_reporter.changed
            if tier.disk is not None:
                tier.disk.record_changes = observer is not None
                tier.disk.take_changes()  # a log from before this observer describes nothing it was told

    def poll_disk_tier(self) -> None:
        """Report the disk tier's files written and dropped since the last call (its writer thread's work) to the
        observer; on the engine thread, before a step's events are collected (`paged_jax.kv_cache.tier_events`)."""
        if self._tier_reporter is not None:
            self._tier_reporter.poll_disk()

    def _evicted(self, key: BlockHash, page_id: int) -> None:
        """A cache entry the pool evicted from the device: reported to the observer as (group, block hash) (keys
        past group 0 carry a suffix), then copied to the host tier (when there is one; reported stored there)."""
        if self.snapshots is not None:
            self.snapshots.evicted(key)
        if self.observer is not None:
            group, block_hash = split_cache_key(key)
            self.observer.blocks_removed(group, (block_hash,))
        if self.host_tier is not None:
            self.host_tier.offload(key, page_id)
            if self._tier_reporter is not None:
                self._tier_reporter.device_evicted(key)

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

    def lookup_restores(self, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> tuple[int, int]:
        """``lookup_prefix``'s hit and the pages (all groups) of it only the host tier holds: the host -> device
        copies admitting the request now takes (the scheduler's restore budget). Pure, like ``lookup_prefix``."""
        hashes: list[BlockHash] = []
        num_hits = self._hit_blocks(token_ids, extra_keys, hashes)
        if self.host_tier is None or not num_hits:
            return num_hits * self.page_size, 0
        cached = num_hits * self.page_size
        first = self._first_blocks([self.first_readable_block(cached, w) for w in self.windows])
        device = self.pool.cached
        restores = sum(
            self.cache_key(hashes[i], g) not in device for g, lo in enumerate(first) for i in range(lo, num_hits)
        )
        return cached, restores

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def page_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's block table of ``group`` as physical page ids (a fresh list; 0: a dropped block)."""
        return [p.page_id for p in self._get(request_id).tables[group]]

    def block_tables(self, request_id: str) -> list[list[int]]:
        """Every group's block table as physical page ids, in group order (a window group's dropped blocks: 0)."""
        return [[p.page_id for p in table] for table in self._get(request_id).tables]

    def step_tables(self, request_ids: Sequence[str]) -> np.ndarray:
        """The block tables of ``request_ids``, in order, as one ``[G, len(request_ids), width]`` int32 array (a
        copy; 0: the null page, for a dropped block and past a table's end; ``width``: the longest of them), gathered
        from the persistent tables (`paged_jax.kv_cache.block_table`): what a step hands the runner."""
        requests = self.requests
        try:
            rows = [requests[rid].row for rid in request_ids]
        except KeyError as e:
            raise KeyError(f"unknown request {e.args[0]!r}") from None
        return self.block_tables_array.gather(rows)

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

    def block_hash(self, request_id: str, block: int) -> BlockHash:
        """The chained hash of the request's full block `block` (known once the block is scheduled with
        caching on)."""
        return self._get(request_id).block_hashes[block]

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
        # Per group, its hit pages; None: a block only the host tier holds (restored into a fresh page).
        hits: list[list[Page | None]] = [
            [lookup.get(self.cache_key(hashes[i], g)) for i in range(lo, num_hits)] for g, lo in enumerate(first)
        ]
        num_revived = sum(1 for group_hits in hits for b in group_hits if b is None or b.ref_cnt == 0)
        if self.num_groups * (need - num_hits) + num_revived > self.pool.free_queue.num_free:
            return None
        # Revive every group's hits first: they leave the free list, so the allocation below cannot evict them.
        for g, group_hits in enumerate(hits):
            for page in group_hits:
                if page is not None:
                    self._group_pages[g] += page.ref_cnt == 0
                    self.pool.touch(page)
        if self.host_tier is not None:
            self._restore(hits, first, hashes, token_ids, extra_keys)
        fresh = need - num_hits
        new = self.pool.allocate(self.num_groups * fresh)  # every group's at once
        tables: list[list[Page]] = []
        for g, (lo, group_hits) in enumerate(zip(first, hits, strict=True)):
            # `_restore` filled every None
            tables.append([self._null] * lo + cast(list[Page], group_hits) + new[g * fresh : (g + 1) * fresh])
            self._group_pages[g] += fresh
        row = self.block_tables_array.new_row()
        self.block_tables_array.reserve(need)
        self.block_tables_array.array[:, row, :need] = [[p.page_id for p in table] for table in tables]
        self.block_tables_array.lengths[row] = need
        state = RequestPages(tables, total, hashes, num_hits, extra_keys, dropped, row, self._drop_at(dropped))
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
        # Fast path (most decode steps): nothing to copy or allocate, so nothing can fail; a window drop that is due
        # only frees pages.
        if (
            not num_draft
            and not state.num_draft
            and not state.may_share
            and 0 <= num_new_tokens
            and total <= len(state.tables[0]) * self.page_size
            and len(token_ids) >= total
        ):
            if start >= state.drop_at:
                for wi, window in enumerate(self.windows):
                    upto = max(0, start - window + 1) // self.page_size  # first_readable_block
                    if upto > state.dropped[wi]:
                        self._drop(state, wi, upto)
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
        dropped = state.dropped
        for wi, window in enumerate(self.windows):
            upto = max(0, start - window + 1) // ps  # first_readable_block
            lo = dropped[wi]
            if upto > lo:
                drops.append((wi, upto))
                for g in self._window_groups[wi]:
                    for page in tables[g][lo:upto]:
                        gain += page.ref_cnt == 1
        if num_new_pages > 0 and need > self.num_pages - 1:
            after = dict(drops)
            first = self._first_blocks([after.get(wi, d) for wi, d in enumerate(dropped)])
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
            array = self.block_tables_array.array
            index = start // ps
            src = tables[g][index]
            dst = self.pool.allocate(1)[0]
            tables[g][index] = dst
            array[g, state.row, index] = dst.page_id
            self._group_pages[g] += 1
            self.pool.release_page(src)  # refcount was > 1: src stays in use by its other holders
            copies.append(PageCopy(src.page_id, dst.page_id))
        if writes:
            state.may_share = False
        if num_new_pages > 0:
            self._append_pages(state, num_new_pages)
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
        held = len(state.tables[0])
        if held > keep:
            for g, table in enumerate(state.tables):
                while len(table) > keep:  # fresh pages of this step: refcount 1, never hashed
                    self._release(table.pop(), g)
            self.block_tables_array.array[:, state.row, keep:held] = NULL_PAGE
            self.block_tables_array.lengths[state.row] = keep
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
        row = self.block_tables_array.new_row()
        array = self.block_tables_array.array
        held = len(parent.tables[0])
        array[:, row, :held] = array[:, parent.row, :held]
        self.block_tables_array.lengths[row] = held
        self.requests[child_id] = RequestPages(
            [list(table) for table in parent.tables],
            parent.num_computed,
            list(parent.block_hashes),
            parent.num_cached_blocks,
            parent.extra_keys,
            list(parent.dropped),
            row,
            parent.drop_at,
            may_share=True,
        )

    def take_transfers(self) -> KVTransfers | None:
        """The copies between the device and the host tier this step's decisions need (evictions to copy out,
        hits to copy in), for the worker to run before the step; None when there are none or no tier. Called once
        per step, after the last allocation of the step (`paged_jax.kv_cache.host_tier`: step discipline)."""
        return None if self.host_tier is None else self.host_tier.take()

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
        self.block_tables_array.free_row(state.row)

    def reset_prefix_cache(self) -> bool:
        """Drop every prefix-cache entry (as vLLM's `reset_prefix_cache`): only while no request holds pages, since a
        running request's blocks must stay findable by the requests that share them. Returns whether it did."""
        if self.requests:
            return False
        self.pool.clear_cache()
        if self.snapshots is not None:
            self.snapshots.clear()
        if self.observer is not None:
            self.observer.cleared()
        if self._tier_reporter is not None:
            self._tier_reporter.cleared()
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
            for g, (group, table) in enumerate(zip(self.groups, state.tables, strict=True)):
                if fill and table and table[-1].page_id not in empty:
                    empty[table[-1].page_id] = ps - fill
                    group_empty[g] += ps - fill
                if group.window is None:
                    continue
                lo_tok = max(0, state.num_computed - group.window + 1)
                first = lo_tok // ps
                if first < len(table) and table[first].page_id != NULL_PAGE and lo_tok % ps:
                    pid, n = table[first].page_id, lo_tok % ps
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
            prefix_hits_host=self._prefix_hits_host,
            evictions=pool.num_evictions,
            host=None if self.host_tier is None else self.host_tier.stats(),
            disk=None if self.host_tier is None or self.host_tier.disk is None else self.host_tier.disk.stats(),
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
        null, release, group_pages = self._null, self.pool.release_page, self._group_pages
        lo = state.dropped[wi]
        tables = state.tables
        for g in self._window_groups[wi]:
            table = tables[g]
            for i in range(lo, upto):
                page = table[i]
                if page is not null:
                    table[i] = null
                    if release(page):
                        group_pages[g] -= 1
        g0, g1 = self._window_group_span[wi]
        self.block_tables_array.array[g0:g1, state.row, lo:upto] = NULL_PAGE
        state.dropped[wi] = upto
        state.drop_at = self._drop_at(state.dropped)

    def _append_pages(self, state: RequestPages, n: int) -> None:
        """Every group's table grows by ``n`` fresh pages, taken from the pool in one call (the caller checked
        they are free)."""
        num_groups = self.num_groups
        new = self.pool.allocate(num_groups * n)
        held = len(state.tables[0])
        group_pages = self._group_pages
        tables = self.block_tables_array
        if held + n > tables.width:
            tables.reserve(held + n)
        if n == 1:
            for g, table in enumerate(state.tables):
                table.append(new[g])
                group_pages[g] += 1
            tables.array[:, state.row, held] = [p.page_id for p in new]
        else:
            for g, table in enumerate(state.tables):
                table.extend(new[g * n : (g + 1) * n])
                group_pages[g] += n
            ids = np.fromiter((p.page_id for p in new), np.int32, num_groups * n)
            tables.array[:, state.row, held : held + n] = ids.reshape(num_groups, n)
        tables.lengths[state.row] = held + n

    def _release(self, page: Page, group: int) -> None:
        """Drop one reference of a page of ``group``; the group's count of pages loses it at refcount 0."""
        if self.pool.release_page(page):
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
        cached = self._known
        h = (len(token_ids) - 1) // self.page_size
        for g in self._full_groups:
            i = 0
            while i < h:
                self.hasher.extend(hashes, token_ids, i + 1, extra_keys)
                if self.cache_key(hashes[i], g) not in cached:
                    break
                i += 1
            h = i
        if self.snapshots is not None:  # a hybrid's hit also needs the linear layers' state at that point
            h = self.snapshots.usable_blocks(hashes, h)
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
        cached, ps = self._known, self.page_size
        while h > 0:
            lo = self.first_readable_block(h * ps, window)
            miss = next((i for i in range(h - 1, lo - 1, -1) if self.cache_key(hashes[i], group) not in cached), None)
            if miss is None:
                return h
            h = miss
        return 0

    def _restore(
        self,
        hits: list[list[Page | None]],
        first: Sequence[int],
        hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        extra_keys: tuple[str, ...],
    ) -> None:
        """Fill each host-tier hit (a None in ``hits``) with a fresh page, cached under its key, that the worker
        copies the block into before the step (and reported stored on the device). Every slot is claimed (pinned)
        before any page is allocated, so the evictions those allocations cause cannot reuse a slot still to be
        read."""
        tier = self.host_tier
        assert tier is not None
        claims = [
            (g, j, self.cache_key(hashes[lo + j], g), tier.claim(self.cache_key(hashes[lo + j], g)))
            for g, (lo, group_hits) in enumerate(zip(first, hits, strict=True))
            for j, page in enumerate(group_hits)
            if page is None
        ]
        restored_blocks = set()
        restored: list[list[int]] = [[] for _ in hits]
        for g, j, key, slot in claims:
            page = self.pool.allocate(1)[0]
            self.pool.cache(page, key)
            tier.restore(slot, page.page_id)
            hits[g][j] = page
            self._group_pages[g] += 1
            restored_blocks.add(first[g] + j)
            restored[g].append(first[g] + j)
        self._prefix_hits_host += len(restored_blocks) * self.page_size
        for g, blocks in enumerate(restored):
            self._report_blocks(g, hashes, token_ids, extra_keys, blocks)

    def _cache_full_blocks(self, state: RequestPages, token_ids: Sequence[int]) -> None:
        """Offer the request's newly completed full blocks (in every group still holding them) to the cache."""
        num_full = state.num_computed // self.page_size
        if num_full <= state.num_cached_blocks:
            return
        if self.enable_prefix_caching:
            hashes = state.block_hashes
            self.hasher.extend(hashes, token_ids, num_full, state.extra_keys)
            null, cache, lo, observer = self._null, self.pool.cache, state.num_cached_blocks, self.observer
            if observer is None and self.host_tier is None:
                self._cache_blocks_plain(state.tables, hashes, lo, num_full)
                state.num_cached_blocks = num_full
                return
            for g, table in enumerate(state.tables):
                suffix = self._key_suffix[g]
                run = lo  # the first block of the run of new entries being reported
                for i in range(lo, num_full):
                    page = table[i]
                    new = page is not null and page.block_hash is None
                    if page is not null:
                        key = BlockHash(hashes[i] + suffix) if g else hashes[i]  # cache_key
                        stored = cache(page, key)
                        if stored and self.host_tier is not None:
                            self.host_tier.persist(key, page.page_id)
                        new = stored and new
                    if observer is not None and not new:
                        self._report_stored(state, token_ids, g, run, i)
                        run = i + 1
                if observer is not None:
                    self._report_stored(state, token_ids, g, run, num_full)
        state.num_cached_blocks = num_full

    def _cache_blocks_plain(self, tables: list[list[Page]], hashes: list[BlockHash], lo: int, hi: int) -> None:
        """Blocks ``[lo, hi)`` of every group's table become cache entries where no page holds their key yet
        (``PagePool.cache``, inlined, for a manager with no host tier and no observer: every page crossing of a
        decode step comes here once per group)."""
        cached, null, suffixes = self.pool.cached, self._null, self._key_suffix
        for g, table in enumerate(tables):
            suffix = suffixes[g]
            for i in range(lo, hi):
                page = table[i]
                if page is null:
                    continue
                key = BlockHash(hashes[i] + suffix) if g else hashes[i]  # cache_key
                if key in cached:
                    continue  # this page (a hit) or another one holds the entry
                if page.block_hash is not None:
                    raise RuntimeError(f"page {page.page_id} is already cached under another hash")
                page.block_hash = key
                cached[key] = page

    def _report_stored(self, state: RequestPages, token_ids: Sequence[int], group: int, lo: int, hi: int) -> None:
        """Tell the observer that blocks ``[lo, hi)`` of ``state`` became entries of ``group`` (nothing if empty)."""
        self._report_run(group, state.block_hashes, token_ids, state.extra_keys, lo, hi)

    def _report_blocks(
        self,
        group: int,
        hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        extra_keys: tuple[str, ...],
        blocks: Sequence[int],
    ) -> None:
        """Tell the observer that the blocks at indices ``blocks`` (ascending) of a prompt with block hashes
        ``hashes`` became device entries of ``group``: one report per run of consecutive indices."""
        start = 0
        for k in range(1, len(blocks) + 1):
            if k == len(blocks) or blocks[k] != blocks[k - 1] + 1:
                self._report_run(group, hashes, token_ids, extra_keys, blocks[start], blocks[k - 1] + 1)
                start = k

    def _report_run(
        self,
        group: int,
        hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        extra_keys: tuple[str, ...],
        lo: int,
        hi: int,
    ) -> None:
        """Tell the observer that blocks ``[lo, hi)`` of a prompt became device entries of ``group``."""
        if hi <= lo or self.observer is None:
            return
        ps = self.page_size
        parent = hashes[lo - 1] if lo else None
        tokens = token_ids[lo * ps : hi * ps]
        self.observer.blocks_stored(group, hashes[lo:hi], parent, tokens, extra_keys)
        if self._tier_reporter is not None:
            self._tier_reporter.remember([self.cache_key(h, group) for h in hashes[lo:hi]], parent, tokens, extra_keys)


class _Known:
    """Membership in the device prefix cache or the host tier: the keys a prefix lookup can hit."""

    __slots__ = ("device", "host")

    def __init__(self, device: dict[BlockHash, Page], host: HostTier) -> None:
        self.device = device
        self.host = host

    def __contains__(self, key: object) -> bool:
        return key in self.device or key in self.host
