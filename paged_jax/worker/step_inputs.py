"""One step's device inputs, built on the host from the scheduler's output: padded numpy arrays, nothing compiled.

The runner picks the token bucket `T` and the sequence bucket `S` (`paged_jax.worker.buckets`); this module fills the
arrays. Padding is inert: padding tokens write nowhere (slot -1) and sit past `cu_q_lens[num_seqs]`, padding
sequences have no keys and point every block at the null page 0, padding sample rows are greedy and ignored.

A sequence with draft tokens (speculative decoding) puts them after its new tokens, and its 1 + k sample rows
read the logits of its last real token and of each draft.

A token whose id is still on the device (the one-step lookahead, `paged_jax.engine.lookahead`) is a 0 in `token_ids`
with the row of the previous step's samples that holds it in `prev_rows`; the runner merges it in on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from paged_jax.sched.output import SampleRow, SchedulerOutput
from paged_jax.worker.logit_bias import fill_logit_bias
from paged_jax.worker.sampler import SamplingMeta, empty_meta


class SamplerFlags(NamedTuple):
    """Which compiled variant of the sampler a step needs (its static arguments): rows that sample (not all
    greedy), rows with top-k/top-p/min-p, rows with penalties (the token history is carried), rows that want
    logprobs."""

    do_sample: bool
    do_filter: bool
    do_penalty: bool
    want_logprobs: bool


@dataclass(slots=True)
class StepInputs:
    """The forward step's inputs, padded to `T` tokens and `S` sequences (see
    `paged_jax.worker.paged_attention.PagedMeta`)."""

    token_ids: np.ndarray  # [T] i32; 0 for padding and for ids still on the device
    positions: np.ndarray  # [T] i32 position of each token in its sequence
    # [T] i32 physical slot (page * page_size + offset) of each new token; -1: padding. KV cache groups: [G, T],
    # row g in group g's pages
    slot_mapping: np.ndarray
    kv_lens: np.ndarray  # [S] i32 keys per sequence after this step (0 for padding sequences)
    # [S, max_blocks] i32 page of each logical block (0 = the null page); KV cache groups: [G, S, max_blocks]
    block_tables: np.ndarray
    cu_q_lens: np.ndarray  # [S + 1] i32 cumulative query counts
    num_seqs: np.ndarray  # [1] i32 real sequences
    logits_indices: np.ndarray  # [S] i32 the flat token whose logits sample row r draws from
    prev_rows: np.ndarray  # [T] i32 row of the previous step's samples holding the token's id; -1: on the host
    lora_slots: np.ndarray  # [T] i32 the LoRA device slot of each token's sequence (0: none, and padding)

    @property
    def has_pending(self) -> bool:
        """Some token's id is still on the device (the runner merges it in before the forward step)."""
        return bool((self.prev_rows >= 0).any())


def build_step_inputs(
    sched: SchedulerOutput, t: int, s: int, page_size: int, max_blocks: int, num_groups: int = 1
) -> StepInputs:
    """The step inputs of `sched` for token bucket `t` and sequence bucket `s` (both at least what it holds);
    `num_groups` > 1: one block table and slot mapping per KV cache group (`SchedulerOutput.block_tables`)."""
    num_seqs = len(sched.scheduled)
    if sched.num_tokens > t or max(num_seqs, len(sched.sample_rows)) > s:
        raise ValueError(
            f"a step of {sched.num_tokens} tokens, {num_seqs} sequences and "
            f"{len(sched.sample_rows)} sample rows does not fit buckets T={t}, S={s}"
        )
    given = sched.block_tables
    if given.shape[0] != num_groups or given.shape[1] != num_seqs or given.shape[2] > max_blocks:
        raise ValueError(
            f"block tables of shape {given.shape} for {num_groups} KV groups, {num_seqs} sequences and at most "
            f"{max_blocks} blocks"
        )
    token_ids = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    seq_of_token = np.zeros(t, np.intp)
    slots = np.full((num_groups, t), -1, np.int32)
    kv_lens = np.zeros(s, np.int32)
    tables = np.zeros((num_groups, s, max_blocks), np.int32)
    tables[:, :num_seqs, : given.shape[2]] = given
    cu = np.zeros(s + 1, np.int32)
    prev_rows = np.full(t, -1, np.int32)
    lora_slots = np.zeros(t, np.int32)
    off = 0
    for i, item in enumerate(sched.scheduled):
        seq, start, n = item.seq, item.start, item.num_scheduled
        if n == 1 and not item.draft:
            if seq.pending is not None and start == seq.num_tokens - 1:
                prev_rows[off] = seq.pending.row
            else:
                token_ids[off] = seq.all_token_ids[start]
        else:
            token_ids[off : off + item.num_new] = seq.all_token_ids[start : start + item.num_new]
            token_ids[off + item.num_new : off + n] = item.draft
        if n == 1:
            positions[off] = start
            seq_of_token[off] = i
            lora_slots[off] = seq.lora_slot
        else:
            positions[off : off + n] = np.arange(start, start + n, dtype=np.int32)
            seq_of_token[off : off + n] = i
            lora_slots[off : off + n] = seq.lora_slot
        off += n
        kv_lens[i] = start + n
        cu[i + 1] = off
    cu[num_seqs + 1 :] = off
    pos = positions[:off]
    slots[:, :off] = tables[:, seq_of_token[:off], pos // page_size] * page_size + pos % page_size
    for i, item in enumerate(sched.scheduled):
        if item.rerun:  # recomputed for a hybrid's state: their KV is in the pages already (`ScheduledSeq`)
            slots[:, cu[i] : cu[i] + item.rerun] = -1
    logits_indices = np.zeros(s, np.int32)
    for r, row in enumerate(sched.sample_rows):
        logits_indices[r] = cu[row.index + 1] - 1 - len(sched.scheduled[row.index].draft) + len(row.draft_prefix)
    if num_groups == 1:
        slots, tables = slots[0], tables[0]
    return StepInputs(
        token_ids,
        positions,
        slots,
        kv_lens,
        tables,
        cu,
        np.array([num_seqs], np.int32),
        logits_indices,
        prev_rows,
        lora_slots,
    )


@dataclass(slots=True)
class SamplingInputs:
    """The sampler's inputs for `S` rows, and which compiled variant of it the step needs."""

    meta: SamplingMeta  # numpy leaves, [S, ...] (see `paged_jax.worker.sampler.SamplingMeta`)
    flags: SamplerFlags
    pending_rows: np.ndarray  # [S] i32 penalized rows whose last token is still on the device: its sample row
    pending_cols: np.ndarray  # [S] i32 that token's column in `meta.history`


def build_sampling_inputs(
    rows: list[SampleRow],
    s: int,
    suppress_width: int,
    history_len: int,
    eos_token_ids: tuple[int, ...],
    logit_bias_width: int = 0,
) -> SamplingInputs:
    """The sampling inputs of `rows` padded to `s`. The ban list is `suppress_width` wide; a step with a
    penalized row carries every row's token history in `history_len` columns (1 column otherwise); every step
    carries `logit_bias_width` bias columns (-1 where a row has no bias: one sampler executable for both)."""
    penalized = any(row.seq.params.uses_penalties for row in rows)
    host = empty_meta(s, suppress_width, history_len if penalized else 1, logit_bias_width)
    m = SamplingMeta(**host)  # type: ignore[arg-type]  # host numpy arrays: the jitted step's inputs
    pending_rows = np.full(s, -1, np.int32)
    pending_cols = np.zeros(s, np.int32)
    do_sample = do_filter = want_logprobs = False
    for r, row in enumerate(rows):
        seq, draft_prefix = row.seq, row.draft_prefix
        p = seq.params
        n_out = len(seq.output_token_ids) + len(draft_prefix)  # output index of the token this row draws
        m.temperature[r] = p.temperature
        if p.temperature > 0:
            do_sample = True
            if p.uses_filters:
                do_filter = True
                m.top_k[r], m.top_p[r], m.min_p[r] = p.top_k, p.top_p, p.min_p
        if p.logprobs is not None:
            want_logprobs = True
        if p.logit_bias:
            fill_logit_bias(m.logit_bias_ids[r], m.logit_bias[r], p.logit_bias)  # type: ignore[arg-type]  # numpy here
        seed = (seq.seed + seq.index) % 2**64
        m.seed[r] = (seed & 0xFFFFFFFF, seed >> 32)
        m.step[r] = n_out
        if n_out < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            m.suppress[r, : len(banned)] = banned
        if p.uses_penalties:
            m.repetition_penalty[r] = p.repetition_penalty
            m.presence_penalty[r] = p.presence_penalty
            m.frequency_penalty[r] = p.frequency_penalty
            toks = seq.all_token_ids + list(draft_prefix) if draft_prefix else seq.all_token_ids
            m.history[r, : len(toks)] = toks  # a placeholder (-1) is padding until merged on device
            m.num_prompt[r] = len(seq.prompt_token_ids)
            if seq.pending is not None:
                pending_rows[r], pending_cols[r] = seq.pending.row, len(toks) - 1
    return SamplingInputs(m, SamplerFlags(do_sample, do_filter, penalized, want_logprobs), pending_rows, pending_cols)
