"""The persistent block tables (`paged_jax.kv_cache.block_table`) kept by per-step writes equal the tables rebuilt from
scratch from the manager's own ``Page`` lists, after any sequence of admissions (prefix hits, window drops at
admission), growth (page crossings, window drops, copy-on-write), speculative steps (draft slots rolled back),
forks, preemptions and frees: for one group and for seven (one full-attention group and two windows of three
groups each, Gemma 3's pattern in small). The step gather is checked in several orders and subsets, since a
step's sequences come in any order."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from paged_jax.kv_cache import FULL, KVCacheManager, KVGroup
from paged_jax.kv_cache.block_table import BlockTables
from paged_jax.kv_cache.invariants import check_manager_invariants
from paged_jax.kv_cache.page_bounds import cdiv
from tests.kv_cache.test_kv_stateful import PS, KVCacheMachine


def rebuilt(m: KVCacheManager, request_ids: list[str]) -> np.ndarray:
    """The step tables of `request_ids` built from nothing but each request's page lists."""
    tables = [m.block_tables(rid) for rid in request_ids]
    width = max((len(t[0]) for t in tables), default=0)
    out = np.zeros((m.num_groups, len(request_ids), width), np.int32)
    for i, per_group in enumerate(tables):
        for g, ids in enumerate(per_group):
            out[g, i, : len(ids)] = ids
    return out


class DeltaTablesMachine(KVCacheMachine):
    """`KVCacheMachine`'s rules plus speculative steps, with the persistent tables checked after every rule."""

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), drafts=st.lists(st.integers(0, 3), min_size=1, max_size=9), accept=st.integers(0, 9))
    def speculate(self, data: st.DataObject, drafts: list[int], accept: int) -> None:
        """A decoding request computes its last token and `len(drafts)` draft slots; `accept` of them are kept."""
        m = self.m
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        nc = m.num_computed_tokens(rid)
        tokens = self.tokens[rid] + ([1] if nc == len(self.tokens[rid]) else [])
        if nc != len(tokens) - 1:
            return  # a prompt still being computed takes no drafts
        k = len(drafts)
        old_tables = m.block_tables(rid)
        i = nc // PS
        shared = [g for g, old in enumerate(old_tables) if nc % PS != 0 and m.page_ref_count(old[i]) > 1]
        before = self._snapshot()
        if cdiv(nc + 1 + k, PS) > len(old_tables[0]) and self._live_pages(nc, nc + 1 + k) > m.num_pages - 1:
            with pytest.raises(ValueError):
                m.allocate_slots(rid, tokens, 1, num_draft=k)
            assert self._snapshot() == before
            return
        copies = m.allocate_slots(rid, tokens, 1, num_draft=k)
        if copies is None:
            assert self._snapshot() == before
            return
        assert m.num_draft_slots(rid) == k and len(m.block_tables(rid)[0]) == cdiv(nc + 1 + k, PS)
        tables = m.block_tables(rid)
        assert copies == [(old_tables[g][i], tables[g][i]) for g in shared]
        for g in shared:
            self.device[tables[g][i]] = list(self.device[old_tables[g][i]])
        kept = accept % (k + 1)
        tokens = tokens + drafts[:kept]
        self.tokens[rid] = tokens
        m.accept_drafts(rid, kept, tokens)
        assert len(m.block_tables(rid)[0]) == cdiv(nc + 1 + kept, PS)
        self._write(rid, nc, nc + 1 + kept, len(old_tables[0]))

    @invariant()
    def delta_tables_equal_rebuilt(self) -> None:
        m = self.m  # (`consistent` runs check_manager_invariants: every held row mirrors its pages, others are 0)
        rids = sorted(m.requests)
        for order in (rids, rids[::-1], rids[1::2]):
            got, want = m.step_tables(order), rebuilt(m, order)
            assert got.dtype == np.int32 and got.shape == want.shape, (got.shape, want.shape)
            assert (got == want).all(), (order, got, want)


SETTINGS = settings(
    max_examples=50, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
DeltaTablesMachine.TestCase.settings = SETTINGS
test_one_group_delta_tables = DeltaTablesMachine.TestCase


class SevenGroupDeltaTablesMachine(DeltaTablesMachine):
    GROUPS = (
        KVGroup(None, (0,)),
        *(KVGroup(5, (layer,)) for layer in (1, 2, 3)),
        *(KVGroup(12, (layer,)) for layer in (4, 5, 6)),
    )
    NUM_PAGES = 64


SevenGroupDeltaTablesMachine.TestCase.settings = SETTINGS
test_seven_group_delta_tables = SevenGroupDeltaTablesMachine.TestCase


def test_rows_and_width_grow_and_freed_rows_start_empty() -> None:
    """Past the array's first 8 rows and 16 blocks the contents move along; a row handed out again is empty."""
    m = KVCacheManager(num_pages=2000, page_size=PS, groups=(FULL, KVGroup(20, (1,))))
    assert m.block_tables_array.array.shape == (2, 8, 16)
    for i in range(12):
        assert m.admit(f"r{i}", list(range(i, i + 40 * PS)), 40 * PS, read_cache=False) == 0
    assert m.block_tables_array.array.shape[1:] == (16, 64)
    rids = [f"r{i}" for i in range(12)]
    assert (m.step_tables(rids) == rebuilt(m, rids)).all()
    m.free("r3")
    m.admit("new", list(range(5000, 5003)), 3)
    assert m.step_tables(["new"]).tolist() == [[m.block_tables("new")[0]], [m.block_tables("new")[1]]]
    check_manager_invariants(m)
    with pytest.raises(KeyError, match="r3"):
        m.step_tables(["r1", "r3"])
    assert m.step_tables([]).shape == (2, 0, 0)


def test_block_tables_gather_copies() -> None:
    """A gathered step table is a copy: later writes to the persistent rows leave it as it was."""
    t = BlockTables(1, rows=2, width=2)
    rows = [t.new_row(), t.new_row(), t.new_row()]  # the third grows the rows
    assert rows == [0, 1, 2] and t.array.shape == (1, 4, 2)
    t.array[0, 2, :2] = [7, 8]
    t.lengths[2] = 2
    got = t.gather([2, 0])
    t.array[0, 2, 0] = 9
    assert got.tolist() == [[[7, 8], [0, 0]]]
    t.free_row(2)
    assert not t.array.any() and t.new_row() == 2
