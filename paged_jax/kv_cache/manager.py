"""The facade the scheduler talks to: per-request block tables on top of the page pool.

The scheduler never touches a ``Page`` record; it speaks in request ids, token counts and page ids. Every
mutating call is all or nothing: it validates, then decides whether enough free pages exist, and only
then moves anything. A call that returns ``None`` (not enough pages) or raises leaves the manager exactly
as it was.

Per request the manager keeps an append-only block table with ``len(table) == ceil(num_computed /
page_size)``. So only the last page can be partially filled, and it is the only page a request can
write into; a prefix-cache hit always covers whole pages. That is why copy-on-write only ever concerns
the last page, and only after a ``fork``.

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

from paged_jax.kv_cache.hashing import BlockHash, BlockHasher
from paged_jax.kv_cache.page_bounds import MAX_PAGE_SIZE, MIN_PAGE_SIZE, cdiv
from paged_jax.kv_cache.page_pool import NULL_PAGE, Page, PagePool
from paged_jax.kv_cache.stats import KVCacheStats


class PageCopy(NamedTuple):
    """A copy-on-write instruction: the device copies page `src` to page `dst` (every layer) before the step."""

    src: int
    dst: int


@dataclass(slots=True)
class RequestPages:
    """What the manager knows about one running request."""

    pages: list[Page]
    """The block table, logical block i -> physical page ``pages[i].page_id``; append-only except CoW."""
    num_computed: int
    """Tokens whose KV is (or is being, this step) written into ``pages``."""
    block_hashes: list[BlockHash]
    """Chained hashes of the request's leading full blocks (may run ahead of ``num_cached_blocks``)."""
    num_cached_blocks: int
    """Blocks ``[0, num_cached_blocks)`` have been offered to the prefix cache (== num_computed // size, but
    while an ``allocate_slots(cache=False)`` awaits its ``cache_blocks``)."""
    extra_keys: tuple[str, ...]
    """The first block's extra hash keys (cache salt, adapter): ``paged_jax.kv_cache.hashing``."""
    num_draft: int = 0
    """Slots past ``num_computed`` written with unverified draft tokens this step (speculative decoding); the
    table covers them: ``len(pages) == ceil((num_computed + num_draft) / page_size)``."""


class KVCacheManager:
    """Host-side owner of the paged KV cache: which page holds which block of which request."""

    def __init__(self, num_pages: int, page_size: int = 16, enable_prefix_caching: bool = True) -> None:
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
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = PagePool(num_pages, enable_caching=enable_prefix_caching)
        self.hasher = BlockHasher(page_size)
        self.requests: dict[str, RequestPages] = {}
        self._prefix_queries = 0
        self._prefix_hits = 0

    # ----------------------------------------------------------------------------------------- queries

    def pages_needed(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens: ``ceil(num_tokens / page_size)``."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return cdiv(num_tokens, self.page_size)

    def num_free_pages(self) -> int:
        """Pages with refcount 0, cached-but-free ones included (they are reclaimed on demand)."""
        return self.pool.free_queue.num_free

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens fits in an otherwise empty pool."""
        return self.pages_needed(num_tokens) <= self.num_pages - 1

    def lookup_prefix(self, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> int:
        """Leading tokens whose full blocks are cached (a multiple of page_size). Pure: changes nothing.

        Capped so that at least the last token is left to compute (its logits are needed). Not counted in
        the stats: the scheduler may look up a waiting request every step until it fits; ``admit`` counts.
        """
        return len(self._find_hits(token_ids, extra_keys, [])) * self.page_size

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def page_ids(self, request_id: str) -> list[int]:
        """The request's block table as physical page ids (a fresh list)."""
        return [p.page_id for p in self._get(request_id).pages]

    def block_table_row(self, request_id: str, width: int) -> np.ndarray:
        """The block table as an int32 row of ``width`` entries, padded with the null page."""
        pages = self._get(request_id).pages
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
        for positions ``[0, cached)`` is already in its pages.

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
        hits = self._find_hits(token_ids, extra_keys, hashes) if read_cache else []
        num_hits = len(hits)
        cached = num_hits * self.page_size
        total = cached + min(num_new_tokens, len(token_ids) - cached)
        need = self.pages_needed(total)
        if need > self.num_pages - 1:
            raise ValueError(f"request {request_id!r} needs {need} pages, the pool has {self.num_pages - 1}")
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        if need - num_hits + num_revived > self.pool.free_queue.num_free:
            return None
        # Revive the hits first: they leave the free list, so the allocation below cannot evict them.
        for page in hits:
            self.pool.touch(page)
        pages = hits  # the table starts with the hit pages
        pages.extend(self.pool.allocate(need - num_hits))
        state = RequestPages(pages, total, hashes, num_hits, extra_keys)
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

        Allocates the pages this needs, all or nothing (``None``: not enough free pages, nothing changed).
        If the page written first is shared (refcount > 1, after a ``fork``) the request gets a private
        copy and the call returns ``[(src_page, dst_page)]``: the device must copy src to dst before the
        step writes. Otherwise returns ``[]``. Newly completed full blocks enter the prefix cache, and the
        request's ``num_computed`` advances by ``num_new_tokens``.

        ``cache=False`` defers the prefix caching: the engine's one-step lookahead schedules a token whose id
        the device has not returned yet (``token_ids`` holds a placeholder there), and calls
        ``cache_blocks`` once the id is known.

        ``num_draft``: slots for that many draft tokens after the new ones (speculative decoding), allocated
        with them but not counted as computed and never hashed; the step's ``accept_drafts`` settles them.
        """
        state = self._get(request_id)
        if num_new_tokens < 0 or num_draft < 0:
            raise ValueError(f"num_new_tokens and num_draft must be >= 0, got {num_new_tokens}, {num_draft}")
        if state.num_draft:
            raise ValueError(f"request {request_id!r}: the previous step's drafts were not settled (accept_drafts)")
        ps = self.page_size
        start = state.num_computed
        total = start + num_new_tokens
        if len(token_ids) < total:
            raise ValueError(f"request {request_id!r}: {total} tokens to compute, {len(token_ids)} given")
        pages = state.pages
        need = cdiv(total + num_draft, ps)
        if need > self.num_pages - 1:
            raise ValueError(f"request {request_id!r} needs {need} pages, the pool has {self.num_pages - 1}")
        num_new_pages = need - len(pages)
        cow = num_new_tokens + num_draft > 0 and start % ps != 0 and pages[start // ps].ref_cnt > 1
        if num_new_pages + cow > self.pool.free_queue.num_free:
            return None
        copies: list[PageCopy] = []
        if cow:
            index = start // ps
            src = pages[index]
            dst = self.pool.allocate(1)[0]
            pages[index] = dst
            self.pool.release(src)  # refcount was > 1: src stays in use by its other holders
            copies.append(PageCopy(src.page_id, dst.page_id))
        if num_new_pages > 0:
            pages.extend(self.pool.allocate(num_new_pages))
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
        while len(state.pages) > keep:  # fresh pages of this step: refcount 1, never hashed
            self.pool.release(state.pages.pop())
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
        for page in parent.pages:
            self.pool.touch(page)
        self.requests[child_id] = RequestPages(
            list(parent.pages),
            parent.num_computed,
            list(parent.block_hashes),
            parent.num_cached_blocks,
            parent.extra_keys,
        )

    def free(self, request_id: str) -> None:
        """Release a finished, aborted or preempted request's pages; raises ``KeyError`` if unknown.

        Pages go back tail first, so among one request's cached pages the one ending the longest prefix
        is evicted first and the shared leading blocks last. Full blocks stay cached, so a preempted
        request recomputed later mostly hits the prefix cache.
        """
        state = self._get(request_id)
        del self.requests[request_id]
        for page in reversed(state.pages):
            self.pool.release(page)

    # ----------------------------------------------------------------------------------- introspection

    def stats(self) -> KVCacheStats:
        """A snapshot; O(number of requests)."""
        ps = self.page_size
        pool = self.pool
        total = self.num_pages - 1
        free = pool.free_queue.num_free
        in_use = total - free
        # Only a request's last page can be partial, and holders of a shared page agree on its fill.
        empty_slots = 0
        seen: set[int] = set()
        for state in self.requests.values():
            fill = (state.num_computed + state.num_draft) % ps
            if fill and state.pages[-1].page_id not in seen:
                seen.add(state.pages[-1].page_id)
                empty_slots += ps - fill
        queries, hits = self._prefix_queries, self._prefix_hits
        return KVCacheStats(
            pages_total=total,
            pages_free=free,
            pages_cached_free=pool.num_cached_free,
            pages_in_use=in_use,
            slot_utilization=(in_use * ps - empty_slots) / (in_use * ps) if in_use else 1.0,
            prefix_queries=queries,
            prefix_hits=hits,
            prefix_hit_rate=hits / queries if queries else 0.0,
            evictions=pool.num_evictions,
        )

    # ---------------------------------------------------------------------------------------- internal

    def _get(self, request_id: str) -> RequestPages:
        state = self.requests.get(request_id)
        if state is None:
            raise KeyError(f"unknown request {request_id!r}")
        return state

    def _find_hits(self, token_ids: Sequence[int], extra_keys: tuple[str, ...], hashes: list[BlockHash]) -> list[Page]:
        """Cached pages of the leading full blocks, stopping at the first miss; fills ``hashes`` on the way.

        At most ``(len - 1) // page_size`` blocks, so the last token is always left to compute.
        """
        hits: list[Page] = []
        if not self.enable_prefix_caching:
            return hits
        lookup = self.pool.cached.get
        for i in range((len(token_ids) - 1) // self.page_size):
            self.hasher.extend(hashes, token_ids, i + 1, extra_keys)
            page = lookup(hashes[i])
            if page is None:
                break
            hits.append(page)
        return hits

    def _cache_full_blocks(self, state: RequestPages, token_ids: Sequence[int]) -> None:
        """Offer the request's newly completed full blocks to the prefix cache."""
        num_full = state.num_computed // self.page_size
        if num_full <= state.num_cached_blocks:
            return
        if self.enable_prefix_caching:
            self.hasher.extend(state.block_hashes, token_ids, num_full, state.extra_keys)
            for i in range(state.num_cached_blocks, num_full):
                self.pool.cache(state.pages[i], state.block_hashes[i])
        state.num_cached_blocks = num_full
