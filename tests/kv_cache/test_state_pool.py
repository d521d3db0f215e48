"""The recurrent-state slot table (`paged_jax.kv_cache.state_pool`): slot 0 never handed out, every slot once free
or owned, a fork's copy recorded once and dropped when the child leaves before it ran, clear errors."""

from __future__ import annotations

import pytest

from paged_jax.kv_cache import StateCopy, StateSlots
from paged_jax.kv_cache.invariants import check_state_slots


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
