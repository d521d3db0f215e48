"""The recurrent-state slot table (`paged_jax.kv_cache.state_pool`): slot 0 never handed out, every slot once free
or owned, a fork's copy recorded once and dropped when the child leaves before it ran, clear errors. The state
snapshots (`paged_jax.kv_cache.state_snapshots`): their points, a hit only at a committed snapshot, LRU rows,
dropped with their block's page."""

from __future__ import annotations

import pytest

from paged_jax.kv_cache import BlockHash, StateCopy, StateSlots
from paged_jax.kv_cache.invariants import check_state_slots
from paged_jax.kv_cache.state_snapshots import StateSnapshots


def test_slots_are_handed_out_and_returned():
    slots = StateSlots(3)
    got = [slots.acquire(s) for s in ("a", "b", "c")]
    assert sorted(got) == [1, 2, 3] and slots.num_free == 0
    with pytest.raises(RuntimeError, match="no free state slot"):
        slots.acquire("d")
    with pytest.raises(ValueError, match="already holds state slot"):
        slots.acquire("a")
    slots.release("b")
    assert slots.acquire("d") == got[1]  # the freed row is reused
    assert list(slots.step_slots(["d", "a"])) == [got[1], got[0]]
    check_state_slots(slots, ["a", "c", "d"])
    with pytest.raises(RuntimeError, match="hold no pages"):
        check_state_slots(slots, ["a", "c"])
    with pytest.raises(KeyError, match="holds no state slot"):
        slots.release("zz")


def test_fork_records_one_copy():
    slots = StateSlots(5)
    parent = slots.acquire("p")
    kids = [slots.fork("p", f"p.{i}") for i in range(3)]
    assert slots.take_copies() == [StateCopy(parent, k) for k in kids]
    assert slots.take_copies() == []  # once
    slots.fork("p", "late")
    slots.release("late")  # the child left before its copy ran: nothing to copy
    assert slots.take_copies() == []
    check_state_slots(slots, ["p", "p.0", "p.1", "p.2"])


def test_snapshot_points_lookup_and_lifetime():
    snaps = StateSnapshots(capacity=2, first_row=5, page_size=8, interval=16)
    assert snaps.points(45) == [16, 32, 40] and snaps.points(7) == [] and snaps.points(32) == [16, 32]
    assert snaps.next_point(45, 16) == 32 and snaps.next_point(45, 40) is None
    a, b, c = (BlockHash(bytes([i]) * 32) for i in range(3))
    hashes = [a, b, c]
    snaps.save(b, slot=1)
    assert snaps.take_saves() == [StateCopy(1, 5)]
    assert snaps.usable_blocks(hashes, 3) == 0  # saved this step: not a hit before the next schedule
    snaps.commit()
    assert snaps.usable_blocks(hashes, 3) == 2 and snaps.usable_blocks(hashes, 1) == 0
    snaps.restore(b, slot=3)
    assert snaps.take_restores() == [StateCopy(5, 3)] and snaps.num_hits == 1
    snaps.save(a, slot=1)
    snaps.save(c, slot=2)  # full: the least recently used (b) goes
    snaps.commit()
    assert snaps.usable_blocks(hashes, 3) == 3 and snaps.usable_blocks(hashes, 2) == 1
    snaps.evicted(c)  # its page left the prefix cache
    assert snaps.usable_blocks(hashes, 3) == 1
    snaps.check()
    snaps.clear()
    assert snaps.num_cached == 0
    snaps.check()


def test_speculation_checkpoints_rollbacks_and_reruns():
    """A verify's checkpoint (slot -> its row after the snapshots), a rejection's rollback (row -> slot) with the
    tokens to re-run, both dropped with the slot; no checkpoint over a pending rollback; broken records caught."""
    slots = StateSlots(3, checkpoint_row=6)  # rows: null, 3 slots, 2 snapshot rows, then 3 checkpoints
    a, b = slots.acquire("a"), slots.acquire("b")
    slots.checkpoint("a")
    slots.checkpoint("b")
    assert slots.take_checkpoints() == [StateCopy(a, 6 + a - 1), StateCopy(b, 6 + b - 1)]
    assert slots.take_checkpoints() == []  # once
    slots.rollback("a", 3)
    assert slots.rerun_tokens("a") == 3 and slots.rerun_tokens("b") == 0 and slots.num_rollbacks == 1
    with pytest.raises(ValueError, match="a checkpoint while its state is behind"):
        slots.checkpoint("a")
    with pytest.raises(ValueError, match="a rollback of 2 tokens"):
        slots.rollback("a", 2)  # one pending already
    assert slots.take_checkpoints() == [StateCopy(6 + a - 1, a)]
    slots.rerun_scheduled("a")
    assert slots.rerun_tokens("a") == 0
    slots.rollback("b", 1)
    slots.release("b")  # it stopped before its rollback ran: nothing to copy, nothing to re-run
    assert slots.take_checkpoints() == [] and slots.rerun_tokens("b") == 0
    check_state_slots(slots, ["a"])
    slots._rerun["gone"] = 1  # a broken table: a re-run of a sequence without a slot
    with pytest.raises(RuntimeError, match="rollbacks of sequences without a slot"):
        slots.check()
    plain = StateSlots(2)
    plain.acquire("x")
    with pytest.raises(RuntimeError, match="only with speculative decoding"):
        plain.checkpoint("x")
    with pytest.raises(ValueError, match="checkpoint_row: must follow"):
        StateSlots(3, checkpoint_row=3)
