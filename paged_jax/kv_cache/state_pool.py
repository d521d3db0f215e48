"""Which recurrent-state slot does a running sequence own? The host side of the linear-attention state pool.

A linear-attention hybrid (Qwen3.5's Gated DeltaNet layers, `paged_jax.model.gated_deltanet`) keeps, per running
sequence and per linear layer, a fixed-size state instead of KV pages: the depthwise conv's last ``K - 1`` inputs
and the delta rule's ``[Hv, Dk, Dv]`` matrix. The runner holds one preallocated device array of each per linear
layer with one row per slot (`paged_jax.worker.linear_state`); this table says which row is whose.

- Slot 0 is the null slot: padding rows of a step read and write it, no sequence owns it.
- ``max_num_seqs`` real slots: the scheduler never runs more sequences than that (its children promised
  included), so a sequence that is admitted always finds a free slot; the slots are part of the one memory
  budget, subtracted before the KV pages are sized (`paged_jax.worker.kv_budget`).
- A sequence takes its slot when it starts running (admission, or a fork) and returns it when it stops
  (finish, abort, preemption: a preempted sequence recomputes its state from its first token).
- A slot's stale contents are never read: a step whose chunk starts at position 0 starts from zero states
  (`StateMeta.seq_fresh`), whatever the slot held.
- A fork (n > 1) gives the child a slot and records one copy parent -> child, which the runner makes after the
  step that completes the parent's prompt (the state the child continues from exists only then).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

NULL_SLOT = 0


@dataclass(frozen=True, slots=True)
class StateCopy:
    """Copy state slot `src` to slot `dst` (every linear layer, conv and recurrent state) after the step."""

    src: int
    dst: int


class StateSlots:
    """The slot table of the recurrent-state pool (module docstring): slots 1..num_slots - 1 for sequences."""

    def __init__(self, max_num_seqs: int) -> None:
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be an int >= 1, got {max_num_seqs!r}")
        self.num_slots = max_num_seqs + 1  # slot 0: the null slot
        self._free = list(range(self.num_slots - 1, 0, -1))  # pop() hands out the lowest slot first
        self._owner: dict[str, int] = {}
        self._copies: list[StateCopy] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return len(self._owner)

    def owners(self) -> set[str]:
        """The sequences holding a slot."""
        return set(self._owner)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._owner

    def slot_of(self, seq_id: str) -> int:
        try:
            return self._owner[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} holds no state slot") from None

    def acquire(self, seq_id: str) -> int:
        """Give `seq_id` a slot; raises if it already holds one or none is free (the scheduler's sequence limit
        makes that a bug)."""
        if seq_id in self._owner:
            raise ValueError(f"sequence {seq_id!r} already holds state slot {self._owner[seq_id]}")
        if not self._free:
            raise RuntimeError(f"no free state slot for {seq_id!r}: more running sequences than max_num_seqs")
        slot = self._free.pop()
        self._owner[seq_id] = slot
        return slot

    def release(self, seq_id: str) -> None:
        """Return `seq_id`'s slot (its contents are left; the next owner starts from zeros)."""
        slot = self._owner.pop(seq_id, None)
        if slot is None:
            raise KeyError(f"sequence {seq_id!r} holds no state slot")
        self._free.append(slot)
        self._copies = [c for c in self._copies if c.dst != slot]  # a fork whose child left before it ran

    def fork(self, parent_id: str, child_id: str) -> int:
        """Give the child a slot and record the parent -> child copy (`take_copies`)."""
        slot = self.acquire(child_id)
        self._copies.append(StateCopy(self.slot_of(parent_id), slot))
        return slot

    def take_copies(self) -> list[StateCopy]:
        """The copies recorded since the last call (for the step being scheduled)."""
        copies, self._copies = self._copies, []
        return copies

    def step_slots(self, seq_ids: Sequence[str]) -> np.ndarray:
        """The slots of a step's sequences, in order: [len(seq_ids)] int32."""
        return np.array([self.slot_of(s) for s in seq_ids], np.int32).reshape(len(seq_ids))

    def check(self) -> None:
        """Every slot but the null one exactly once free or owned (RuntimeError naming what is broken)."""
        owned = list(self._owner.values())
        every = sorted(owned + self._free)
        if every != list(range(1, self.num_slots)):
            raise RuntimeError(f"state slot invariant broken: owned {sorted(owned)}, free {sorted(self._free)}")


__all__ = ["NULL_SLOT", "StateCopy", "StateSlots"]
