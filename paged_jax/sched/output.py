"""The scheduler's output: everything the runner needs for one step and nothing more.

Each scheduled sequence's token range, every scheduled sequence's block tables (one array), the rows that sample,
the pages to copy (copy-on-write, and to and from the KV tiers), each sequence's recurrent-state slot
(linear-attention hybrids) and the LoRA adapters to write into device slots
first. The runner never talks to the KV manager; this record is the whole contract between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from paged_jax.kv_cache import KVTransfers, PageCopy, StateCopy
from paged_jax.lora.registry import SlotLoad
from paged_jax.sched.sequence import TokenSequence


@dataclass(slots=True)
class ScheduledSeq:
    """`num_new` tokens of `seq` at positions [start, start + num_new) are computed this step; the first `rerun`
    of them were computed before and their KV is written: a linear-attention hybrid recomputes them for its state
    after a verify rejected a draft (`paged_jax.kv_cache.state_pool`), and the step writes no KV for them."""

    seq: TokenSequence
    start: int
    num_new: int
    draft: list[int] = field(default_factory=list)  # unverified draft tokens at [start + num_new, ... + len(draft))
    # prompt positions p whose logits give the logprob of prompt token p + 1 this step (`prompt_logprobs`)
    prompt_logprob_positions: range = range(0)
    # prompt positions whose final hidden states this step pools (embedding requests, `paged_jax.pooling_params`)
    pool_positions: range = range(0)
    rerun: int = 0

    @property
    def num_scheduled(self) -> int:
        """Tokens this entry puts in the step: its new tokens and its drafts."""
        return self.num_new + len(self.draft)


@dataclass(frozen=True, slots=True)
class SampleRow:
    """One row of the step's samples: `seq` draws its next token from the logits of the last token of
    `scheduled[index]` (its own entry, or its leader's on the step a shared prompt completes).

    With drafts, that entry has 1 + k rows: row `draft_prefix` = d[:j] draws the token after the last real token
    and the first j drafts, from the logits of the j-th draft's position (and is used only if d[:j] is accepted)."""

    seq: TokenSequence
    index: int
    draft_prefix: tuple[int, ...] = ()


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # [G, len(scheduled), width] i32: row i is scheduled[i]'s block table after this step's allocation in every KV
    # cache group (`paged_jax.kv_cache.groups`), logical block j -> page; 0: the null page (a window group's dropped
    # blocks, and past a table's end); width: the longest table. `KVCacheManager.step_tables`.
    block_tables: np.ndarray = field(default_factory=lambda: np.zeros((1, 0, 0), np.int32))
    sample_rows: list[SampleRow] = field(default_factory=list)  # row r of the step's samples
    copy_ops: list[PageCopy] = field(default_factory=list)  # copy-on-write, before the step writes
    lora_loads: list[SlotLoad] = field(default_factory=list)  # adapters to write into device slots, before the step
    kv_transfers: KVTransfers | None = None  # page copies to and from the host tier, before the step (None: none)
    # linear-attention hybrids (`paged_jax.kv_cache.state_pool`): [len(scheduled)] i32 each sequence's state slot,
    # and the copies the runner makes after the step: forks, snapshots (None / empty: no linear layers)
    state_slots: np.ndarray | None = None
    state_copies: list[StateCopy] = field(default_factory=list)
    # before the step: speculation's rollbacks (checkpoint -> slot) and checkpoints (slot -> checkpoint), then
    # prefix hits' snapshot rows into slots
    state_restores: list[StateCopy] = field(default_factory=list)
    preempted: list[TokenSequence] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled
