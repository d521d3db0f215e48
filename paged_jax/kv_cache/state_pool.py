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
- Speculative decoding re-runs a partly rejected verify: with speculation on, slot ``s`` has a checkpoint row
  ``checkpoint_row + s - 1`` (after the snapshot rows, part of the same memory budget). Before a step verifies
  drafts of a sequence its slot is copied there (`checkpoint`). A verify that rejected a draft has run the rejected
  tokens into the state, so the checkpoint is copied back before the next step (`rollback`) and the sequence's
  state is then ``rerun`` tokens behind its computed tokens (the verify's own token and the drafts it kept, whose
  KV pages are written and right): the scheduler puts them back in front of its next chunk (`rerun_tokens`),
  which recomputes them for the linear layers without writing their KV, and verifies no drafts (its checkpoint
  row holds the state it restored). A slot that is released drops its pending rollback and re-run (a preempted
  sequence recomputes everything; the next owner starts from zeros or from its own snapshot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

NULL_SLOT = 0


@dataclass(frozen=True, slots=True)
class StateCopy:
    """Copy state row `src` to row `dst` (every linear layer, conv and recurrent state): a slot, a snapshot or a
    checkpoint row; forks and snapshot saves after the step, restores, checkpoints and rollbacks before it."""

    src: int
    dst: int


class StateSlots:
    """The slot table of the recurrent-state pool (module docstring): slots 1..num_slots - 1 for sequences.
    `checkpoint_row`: the row of slot 1's speculation checkpoint (the others follow it); None: no speculation."""

    def __init__(self, max_num_seqs: int, checkpoint_row: int | None = None) -> None:
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be an int >= 1, got {max_num_seqs!r}")
        self.num_slots = max_num_seqs + 1  # slot 0: the null slot
        if checkpoint_row is not None and checkpoint_row < self.num_slots:
            raise ValueError(f"checkpoint_row: must follow the {self.num_slots} slots, got {checkpoint_row!r}")
        self.checkpoint_row = checkpoint_row
        self._free = list(range(self.num_slots - 1, 0, -1))  # pop() hands out the lowest slot first
        self._owner: dict[str, int] = {}
        self._copies: list[StateCopy] = []
        self._before: list[StateCopy] = []  # checkpoints and rollbacks for the step being scheduled
        self._rerun: dict[str, int] = {}  # tokens a rolled-back sequence's state is behind its computed tokens
        self.num_rollbacks = 0  # verifies that rejected a draft

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
        self._before = [c for c in self._before if slot not in (c.src, c.dst)]  # a rollback of one that stopped
        self._rerun.pop(seq_id, None)

    def fork(self, parent_id: str, child_id: str) -> int:
        """Give the child a slot and record the parent -> child copy (`take_copies`)."""
        slot = self.acquire(child_id)
        self._copies.append(StateCopy(self.slot_of(parent_id), slot))
        return slot

    def take_copies(self) -> list[StateCopy]:
        """The copies recorded since the last call (for the step being scheduled)."""
        copies, self._copies = self._copies, []
        return copies

    def _checkpoint_of(self, slot: int) -> int:
        if self.checkpoint_row is None:
            raise RuntimeError("state checkpoints exist only with speculative decoding on")
        return self.checkpoint_row + slot - 1

    def checkpoint(self, seq_id: str) -> None:
        """`seq_id` verifies drafts in the step being scheduled: copy its slot to its checkpoint row first."""
        if seq_id in self._rerun:
            raise ValueError(f"sequence {seq_id!r}: a checkpoint while its state is behind (a re-run verifies nothing)")
        slot = self.slot_of(seq_id)
        self._before.append(StateCopy(slot, self._checkpoint_of(slot)))

    def rollback(self, seq_id: str, rerun: int) -> None:
        """`seq_id`'s last verify rejected a draft: copy its checkpoint (the state before that verify) back into
        its slot before the next step; its state is then `rerun` (>= 1) tokens behind its computed tokens."""
        if rerun < 1 or seq_id in self._rerun:
            raise ValueError(f"sequence {seq_id!r}: a rollback of {rerun} tokens (pending: {self._rerun.get(seq_id)})")
        slot = self.slot_of(seq_id)
        self._before.append(StateCopy(self._checkpoint_of(slot), slot))
        self._rerun[seq_id] = rerun
        self.num_rollbacks += 1

    def rerun_tokens(self, seq_id: str) -> int:
        """How many tokens before its computed ones `seq_id`'s next chunk recomputes for its state (0: none)."""
        return self._rerun.get(seq_id, 0)

    def rerun_scheduled(self, seq_id: str) -> None:
        """`seq_id`'s re-run is in the step being scheduled: its state catches up there."""
        del self._rerun[seq_id]

    def take_checkpoints(self) -> list[StateCopy]:
        """The rollbacks and checkpoints recorded since the last call, to copy before the step being scheduled
        (no row is both a source and a destination: a rolled-back sequence recomputes, it verifies nothing)."""
        before, self._before = self._before, []
        return before

    def step_slots(self, seq_ids: Sequence[str]) -> np.ndarray:
        """The slots of a step's sequences, in order: [len(seq_ids)] int32."""
        return np.array([self.slot_of(s) for s in seq_ids], np.int32).reshape(len(seq_ids))

    def check(self) -> None:
        """Every slot but the null one exactly once free or owned (RuntimeError naming what is broken)."""
        owned = list(self._owner.values())
        every = sorted(owned + self._free)
        if every != list(range(1, self.num_slots)):
            raise RuntimeError(f"state slot invariant broken: owned {sorted(owned)}, free {sorted(self._free)}")
        stale = [c for c in self._before if c.dst < self.num_slots and c.dst not in owned]
        if stale or not self._rerun.keys() <= self._owner.keys():
            raise RuntimeError(f"state rollbacks of sequences without a slot: {stale}, {sorted(self._rerun)}")


__all__ = ["NULL_SLOT", "StateCopy", "StateSlots"]
