"""Hypothesis state machine: random add / grow / fork / write-to-shared / preempt / resume / free / lookup.

The model is a simulated device: every page's token slots. Each step applies what the manager returned
(copy ops, then the step's writes into fresh or private pages) and then checks, for every running
request, that reading its block table gives back exactly its tokens. So a prefix hit on a wrong or
evicted page, a missed copy-on-write, or a page handed out while still in use shows up as wrong KV, not
just as a bookkeeping mismatch. ``check_manager_invariants`` runs after every step as well.

A small vocabulary and a few shared prefixes make identical blocks (hits, duplicates) common; a pool of
15 usable pages makes evictions, failed allocations and preemptions common.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_jax.kv_cache import FULL, NULL_PAGE, KVCacheManager, KVGroup
from paged_jax.kv_cache.invariants import check_manager_invariants
from paged_jax.kv_cache.page_bounds import cdiv

PS = 8
NUM_PAGES = 16
PREFIXES = [[], [1] * 8, [1] * 8 + [2] * 8, [0, 1, 2, 3] * 6]
SALTS = [None, "tenant"]
token_lists = st.lists(st.integers(0, 3), max_size=20)


class KVCacheMachine(RuleBasedStateMachine):
    GROUPS: tuple[KVGroup, ...] = (FULL,)
    NUM_PAGES = NUM_PAGES

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(num_pages=self.NUM_PAGES, page_size=PS, groups=self.GROUPS)
        self.tokens: dict[str, list[int]] = {}  # running: every known token
        self.salt: dict[str, str | None] = {}
        self.waiting: dict[str, list[int]] = {}  # preempted, to resume later
        self.gone: list[str] = []  # finished ids: freeing them again must raise
        self.device: dict[int, list[int | None]] = {}
        self.counter = 0

    # ----------------------------------------------------------------------------------- helpers

    def _new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    def _snapshot(self) -> tuple:
        m = self.m
        tables = {r: (m.block_tables(r), m.num_computed_tokens(r)) for r in m.requests}
        return m.free_page_ids(), tables, [m.page_ref_count(p) for p in range(m.num_pages)], dict(m.pool.cached)

    def _write(self, rid: str, start: int, stop: int, fresh_from: int) -> None:
        """Poison pages new to the tables (index >= fresh_from), then write tokens [start, stop) in every group."""
        for table in self.m.block_tables(rid):
            for page in table[fresh_from:]:
                self.device[page] = [None] * PS
            for pos in range(start, stop):
                page = table[pos // PS]
                assert page != NULL_PAGE, f"{rid} writes position {pos} into a dropped block"
                assert self.m.page_ref_count(page) == 1, f"{rid} writes into shared page {page}"
                self.device[page][pos % PS] = self.tokens[rid][pos]

    def _live_pages(self, num_computed: int, num_tokens: int) -> int:
        """Pages (all groups) a request holds after computing up to `num_tokens` from `num_computed`."""
        need = cdiv(num_tokens, PS)
        return sum(
            need - (0 if g.window is None else self.m.first_readable_block(num_computed, g.window)) for g in self.GROUPS
        )

    def _admit(self, rid: str, tokens: list[int], chunk: int, salt: str | None) -> None:
        m = self.m
        keys = () if salt is None else (salt,)
        expected = m.lookup_prefix(tokens, keys)
        assert expected % PS == 0 and expected < len(tokens)
        before = self._snapshot()
        cached = m.admit(rid, tokens, chunk, keys)
        if cached is None:
            assert self._snapshot() == before
            self.waiting[rid] = tokens
            self.salt[rid] = salt
            return
        assert cached == expected  # nothing ran between the lookup and the admission
        assert m.num_computed_tokens(rid) == cached + min(chunk, len(tokens) - cached)
        self.tokens[rid] = tokens
        self.salt[rid] = salt
        self._write(rid, cached, m.num_computed_tokens(rid), cached // PS)

    # ------------------------------------------------------------------------------------- rules

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=token_lists,
        chunk=st.integers(1, 40),
        salt=st.sampled_from(SALTS),
    )
    def add(self, prefix: list[int], tail: list[int], chunk: int, salt: str | None) -> None:
        tokens = prefix + tail
        if tokens:
            self._admit(self._new_id(), tokens, chunk, salt)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 40))
    def resume(self, data: st.DataObject, chunk: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        self._admit(rid, self.waiting.pop(rid), chunk, self.salt[rid])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 20), new=token_lists)
    def grow(self, data: st.DataObject, n: int, new: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self._grow(rid, n, new)

    def _grow(self, rid: str, n: int, new: list[int]) -> None:
        m = self.m
        nc = m.num_computed_tokens(rid)
        tokens = self.tokens[rid]
        if nc == len(tokens):  # prompt done: decode new tokens
            tokens = tokens + (new or [0])
        n = min(n, len(tokens) - nc)
        old_tables = m.block_tables(rid)
        i = nc // PS
        shared = [g for g, old in enumerate(old_tables) if nc % PS != 0 and m.page_ref_count(old[i]) > 1]
        before = self._snapshot()
        if cdiv(nc + n, PS) > len(old_tables[0]) and self._live_pages(nc, nc + n) > m.num_pages - 1:
            with pytest.raises(ValueError):
                m.allocate_slots(rid, tokens, n)
            assert self._snapshot() == before
            return
        copies = m.allocate_slots(rid, tokens, n)
        if copies is None:
            assert self._snapshot() == before
            return
        self.tokens[rid] = tokens
        tables = m.block_tables(rid)
        assert copies == [(old_tables[g][i], tables[g][i]) for g in shared]
        for g, (group, old, table) in enumerate(zip(self.GROUPS, old_tables, tables, strict=True)):
            lo = 0 if group.window is None else m.first_readable_block(nc, group.window)
            assert table[:lo] == [NULL_PAGE] * lo  # what the window no longer reads is dropped
            kept = [j for j in range(lo, len(old)) if not (g in shared and j == i)]
            assert [table[j] for j in kept] == [old[j] for j in kept]
            if g in shared:
                self.device[table[i]] = list(self.device[old_tables[g][i]])
        self._write(rid, nc, nc + n, len(old_tables[0]))

    @precondition(lambda self: self.tokens)
    @rule(n=st.integers(1, 9), new=token_lists)
    def engine_step(self, n: int, new: list[int]) -> None:
        """Every running request computes up to n tokens in one step (forks write identical blocks)."""
        for rid in sorted(self.tokens):
            self._grow(rid, n, new)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        self.m.fork(parent, child)
        assert self.m.block_tables(child) == self.m.block_tables(parent)
        self.tokens[child] = list(self.tokens[parent])
        self.salt[child] = self.salt[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=token_lists)
    def write_to_shared(self, data: st.DataObject, new: list[int]) -> None:
        """Write one token into a request whose partial last page is shared: must copy on write."""
        m = self.m
        candidates = [
            r for r in sorted(self.tokens) if m.num_computed_tokens(r) % PS and m.page_ref_count(m.page_ids(r)[-1]) > 1
        ]
        if candidates:
            self._grow(data.draw(st.sampled_from(candidates)), 1, new)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(rid)
        self.waiting[rid] = self.tokens.pop(rid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(rid)
        del self.tokens[rid]
        self.gone.append(rid)

    @precondition(lambda self: self.gone)
    @rule(data=st.data())
    def free_again(self, data: st.DataObject) -> None:
        before = self._snapshot()
        with pytest.raises(KeyError):
            self.m.free(data.draw(st.sampled_from(self.gone)))
        assert self._snapshot() == before

    @rule(prefix=st.sampled_from(PREFIXES), tail=token_lists, salt=st.sampled_from(SALTS))
    def lookup(self, prefix: list[int], tail: list[int], salt: str | None) -> None:
        tokens = prefix + tail
        before = self._snapshot()
        hit = self.m.lookup_prefix(tokens, () if salt is None else (salt,))
        assert self._snapshot() == before
        assert hit % PS == 0 and hit <= max(len(tokens) - 1, 0)

    # -------------------------------------------------------------------------------- invariants

    @invariant()
    def consistent(self) -> None:
        m = self.m
        check_manager_invariants(m)
        in_use: set[int] = set()
        for rid, tokens in self.tokens.items():
            nc = m.num_computed_tokens(rid)
            for group, table in zip(self.GROUPS, m.block_tables(rid), strict=True):
                in_use.update(p for p in table if p != NULL_PAGE)
                reach = 0 if group.window is None else max(0, nc - group.window + 1)  # what future queries read
                for pos in range(reach, nc):
                    page = table[pos // PS]
                    assert page != NULL_PAGE and self.device[page][pos % PS] == tokens[pos], f"{rid} reads wrong KV"
        assert m.num_free_pages() == m.num_pages - 1 - len(in_use)

    def teardown(self) -> None:
        for rid in list(self.tokens):
            self.m.free(rid)
        assert self.m.num_free_pages() == self.m.num_pages - 1
        assert self.m.stats().pages_in_use == 0
        check_manager_invariants(self.m)


KVCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_state_machine = KVCacheMachine.TestCase


class GroupedKVCacheMachine(KVCacheMachine):
    """The same rules over a full-attention group and two window groups (windows below and above a page)."""

    GROUPS = (KVGroup(None, (0,)), KVGroup(5, (1,)), KVGroup(12, (2,)))
    NUM_PAGES = 31


GroupedKVCacheMachine.TestCase.settings = KVCacheMachine.TestCase.settings
test_grouped_kv_cache_state_machine = GroupedKVCacheMachine.TestCase
