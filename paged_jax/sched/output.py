"""The scheduler's output: everything the runner needs for one step and nothing more.

Each scheduled sequence's token range and its page ids, the rows that sample, the pages to copy and the LoRA
adapters to write into device slots first. The
runner never talks to the KV manager; this record is the whole contract between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_jax.kv_cache import PageCopy
from paged_jax.lora.registry import SlotLoad
from paged_jax.sched.sequence import TokenSequence


@dataclass(slots=True)
class ScheduledSeq:
    """`num_new` tokens of `seq` at positions [start, start + num_new) are computed this step."""

    seq: TokenSequence
    start: int
    num_new: int
    page_ids: list[int]  # the sequence's block table after this step's allocation: logical block i -> page
    draft: list[int] = field(default_factory=list)  # unverified draft tokens at [start + num_new, ... + len(draft))
    # KV cache groups 1, 2, ... (`paged_jax.kv_cache.groups`; `page_ids` is group 0's): each one's block table from
    # its first block still held (`group_first_blocks`, 0 in a full group; a window group dropped those before), so
    # block `group_first_blocks[g] + j` -> page `group_page_ids[g][j]`; both empty for a model of one group
    group_page_ids: list[list[int]] = field(default_factory=list)
    group_first_blocks: list[int] = field(default_factory=list)
    # prompt positions p whose logits give the logprob of prompt token p + 1 this step (`prompt_logprobs`)
    prompt_logprob_positions: range = range(0)
    # prompt positions whose final hidden states this step pools (embedding requests, `paged_jax.pooling_params`)
    pool_positions: range = range(0)

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
    sample_rows: list[SampleRow] = field(default_factory=list)  # row r of the step's samples
    copy_ops: list[PageCopy] = field(default_factory=list)  # copy-on-write, before the step writes
    lora_loads: list[SlotLoad] = field(default_factory=list)  # adapters to write into device slots, before the step
    preempted: list[TokenSequence] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled
