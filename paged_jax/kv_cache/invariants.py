"""Full consistency check of a ``KVCacheManager`` (O(pages + table entries + persistent table rows); tests and
debugging).

Called from outside the manager (the engine's `check_invariants`, tests), so the manager never imports it.

Raises ``RuntimeError`` (not ``assert``, which ``python -O`` strips) naming the first broken invariant.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NoReturn

from paged_jax.kv_cache.manager import KVCacheManager
from paged_jax.kv_cache.page_bounds import cdiv
from paged_jax.kv_cache.page_pool import NULL_PAGE
from paged_jax.kv_cache.state_pool import StateSlots


def _fail(msg: str) -> NoReturn:
    raise RuntimeError(f"KV cache invariant broken: {msg}")


def check_manager_invariants(m: KVCacheManager) -> None:
    """Every page in exactly one state, refcounts == table holders (every group's), sound free list, cache map and
    tables (a window group's null entries only below what its future queries read), and the host tier's slots."""
    pool = m.pool
    ps = m.page_size
    pages = pool.pages
    if len(pages) != m.num_pages or any(p.page_id != i for i, p in enumerate(pages)):
        _fail("pool pages are not exactly pages 0..num_pages-1 in order")

    # Tables: one per group, all of one length matching the computed tokens; the null page only where a window
    # group dropped blocks no future query reads; no page twice, nor in two groups; hashes agree.
    holders = [0] * m.num_pages
    partial_fill: dict[int, int] = {}  # page -> fill, for pages that are some request's partial last block
    full_pages: set[int] = set()
    group_of: dict[int, int] = {}
    window_index = {w: i for i, w in enumerate(m.windows)}
    array = m.block_tables_array.array  # [G, rows, width]: a held row mirrors its tables, every other row is zeros
    rows_held: dict[int, str] = {}
    for rid, st in m.requests.items():
        if len(st.tables) != m.num_groups or len(st.dropped) != len(m.windows):
            _fail(f"request {rid!r} has {len(st.tables)} tables and {len(st.dropped)} window counts")
        written = st.num_computed + st.num_draft  # draft slots are held until the step's drafts are settled
        num_full = st.num_computed // ps
        if st.num_cached_blocks != num_full:
            _fail(f"request {rid!r}: {st.num_cached_blocks} blocks offered to the cache, {num_full} full")
        if m.enable_prefix_caching and len(st.block_hashes) < num_full:
            _fail(f"request {rid!r}: {len(st.block_hashes)} hashes for {num_full} full blocks")
        if st.row in rows_held:
            _fail(f"requests {rows_held[st.row]!r} and {rid!r} hold block table row {st.row}")
        rows_held[st.row] = rid
        if m.block_tables_array.lengths[st.row] != len(st.tables[0]):
            _fail(
                f"request {rid!r}: persistent row length {m.block_tables_array.lengths[st.row]}, "
                f"{len(st.tables[0])} blocks"
            )
        for g, (group, table) in enumerate(zip(m.groups, st.tables, strict=True)):
            ids = [b.page_id for b in table]
            mirrored = array[g, st.row].tolist()
            if mirrored != ids + [NULL_PAGE] * (len(mirrored) - len(ids)):
                _fail(f"request {rid!r} group {g}: persistent block table row {mirrored} is not its table {ids}")
            if any(b is not pages[b.page_id] for b in table):
                _fail(f"request {rid!r} holds a block object that is not the pool's")
            if len(ids) != cdiv(written, ps):
                _fail(
                    f"request {rid!r} group {g} has {len(ids)} pages for {st.num_computed} computed tokens + "
                    f"{st.num_draft} drafts"
                )
            lo = 0 if group.window is None else st.dropped[window_index[group.window]]
            if group.window is not None and lo > m.first_readable_block(st.num_computed, group.window):
                _fail(f"request {rid!r} group {g} dropped {lo} blocks, a future query still reads some")
            if any(i != NULL_PAGE for i in ids[:lo]) or NULL_PAGE in ids[lo:]:
                _fail(f"request {rid!r} group {g}: the null page is not exactly its {lo} dropped blocks: {ids}")
            live = ids[lo:]
            if len(set(live)) != len(live):
                _fail(f"request {rid!r} group {g} holds a page twice: {ids}")
            for i in range(lo, len(ids)):
                b = table[i]
                if group_of.setdefault(b.page_id, g) != g:
                    _fail(f"page {b.page_id} is held by groups {group_of[b.page_id]} and {g}")
                holders[b.page_id] += 1
                if b.block_hash is not None and (i >= num_full or b.block_hash != m.cache_key(st.block_hashes[i], g)):
                    _fail(f"request {rid!r} group {g} block {i} (page {b.page_id}) is cached under a key not its own")
            full_pages.update(ids[lo:num_full])
            fill = written % ps
            if fill and ids:
                if partial_fill.setdefault(ids[-1], fill) != fill:
                    _fail(f"page {ids[-1]} is shared by requests that disagree on how full it is")
    if array.shape[0] != m.num_groups:
        _fail(f"persistent block tables for {array.shape[0]} groups, the manager has {m.num_groups}")
    free_rows = [r for r in range(array.shape[1]) if r not in rows_held]
    if array[:, free_rows].any() or m.block_tables_array.lengths[free_rows].any():
        _fail("a block table row no request holds is not all null pages of length 0")
    held = [0] * m.num_groups
    for g in group_of.values():
        held[g] += 1
    if held != m._group_pages:
        _fail(f"groups hold {held} distinct pages, the manager counts {m._group_pages}")
    if not full_pages.isdisjoint(partial_fill):
        _fail(f"pages both full and partial: {sorted(full_pages & set(partial_fill))}")

    # Refcounts and free-list membership.
    null = pages[NULL_PAGE]
    if null.ref_cnt or null.block_hash is not None or null.prev_free or null.next_free:
        _fail("the null page has a refcount, a hash or free-list links")
    for b in pages[1:]:
        if b.ref_cnt != holders[b.page_id]:
            _fail(f"page {b.page_id} refcount {b.ref_cnt} != {holders[b.page_id]} tables holding it")
        in_list = b.prev_free is not None
        if in_list != (b.ref_cnt == 0) or (b.next_free is not None) != in_list:
            _fail(f"page {b.page_id} (refcount {b.ref_cnt}) has free-list links {in_list}")

    # The free list: a proper doubly linked list from head to tail holding exactly the refcount-0 pages.
    fq = pool.free_queue
    if fq.head.prev_free is not None or fq.tail.next_free is not None:
        _fail("free-list sentinels have outer links")
    seen = 0
    prev, node = fq.head, fq.head.next_free
    while node is not fq.tail:
        if node is None or seen > m.num_pages:
            _fail("free list is broken or cyclic")
        if node.prev_free is not prev:
            _fail(f"free list back link of page {node.page_id} is wrong")
        if node.ref_cnt != 0 or node.page_id == NULL_PAGE:
            _fail(f"page {node.page_id} with refcount {node.ref_cnt} is in the free list")
        seen += 1
        prev, node = node, node.next_free
    if fq.tail.prev_free is not prev:
        _fail("free list tail back link is wrong")
    num_zero = sum(1 for b in pages[1:] if b.ref_cnt == 0)
    if seen != fq.num_free or seen != num_zero:
        _fail(f"free list walks {seen} pages, counts {fq.num_free}, {num_zero} pages have refcount 0")

    # The cache map points at pages carrying that hash, and every hashed page is the map's entry.
    for h, b in pool.cached.items():
        if b.block_hash != h:
            _fail(f"cache entry {h.hex()} points at page {b.page_id} carrying another hash")
    cached_free = 0
    for b in pages[1:]:
        if b.block_hash is not None:
            if pool.cached.get(b.block_hash) is not b:
                _fail(f"page {b.page_id} carries a hash the cache map does not point back from")
            if b.ref_cnt == 0:
                cached_free += 1
            elif b.page_id not in full_pages:
                _fail(f"in-use page {b.page_id} is cached but not a full block of any holder")
    if cached_free != pool.num_cached_free:
        _fail(f"{cached_free} cached free pages, counter says {pool.num_cached_free}")
    if not m.enable_prefix_caching and pool.cached:
        _fail("prefix caching is off but the cache map is not empty")
    # The host tier: every slot free or exactly one entry's, in-flight entries held.
    if m.host_tier is not None:
        m.host_tier.check()


def check_state_slots(slots: StateSlots, holders: Iterable[str]) -> None:
    """A linear-attention hybrid's state slots (`paged_jax.kv_cache.state_pool`): every slot but the null one
    exactly once free or owned, and owned by exactly the requests that hold pages (`holders`)."""
    slots.check()
    owners = slots.owners()
    held = set(holders)
    if owners != held:
        _fail(f"state slots of {sorted(owners - held)} hold no pages; pages of {sorted(held - owners)} no slot")
