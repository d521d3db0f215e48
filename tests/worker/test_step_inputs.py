"""Step-input preparation alone (numpy, nothing compiled): bucket padding, slot mapping, block tables, the
lookahead's placeholder rows and the sampling inputs, on small cases checked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.sampling_params import SamplingParams
from paged_jax.sched.output import SampleRow, ScheduledSeq, SchedulerOutput
from paged_jax.sched.sequence import PLACEHOLDER, PendingToken, TokenSequence
from paged_jax.worker.step_inputs import build_sampling_inputs, build_step_inputs

PS = 8  # page size


def seq(rid: str, prompt: list[int], output: list[int] = (), index: int = 0, **params) -> TokenSequence:
    """A sequence with `output` already generated; greedy unless `params` say otherwise."""
    s = TokenSequence(
        f"{rid}#{index}", rid, index, list(prompt), SamplingParams(**({"temperature": 0.0} | params)), seed=7
    )
    for t in output:
        s.append_token(t)
    return s


def step(items: list[ScheduledSeq], rows: list[SampleRow], tables: list[list[list[int]]]) -> SchedulerOutput:
    """`tables[g][i]`: the block table of `items[i]` in KV cache group g (padded here with the null page)."""
    width = max((len(t) for group in tables for t in group), default=0)
    array = np.zeros((len(tables), len(items), width), np.int32)
    for g, group in enumerate(tables):
        for i, table in enumerate(group):
            array[g, i, : len(table)] = table
    return SchedulerOutput(
        scheduled=items, sample_rows=rows, num_tokens=sum(i.num_new for i in items), block_tables=array
    )


def test_prefill_decode_and_a_placeholder_in_one_step():
    a = seq("a", list(range(100, 110)))  # a 10-token prompt, computed whole: pages 3, 5
    b = seq("b", [1, 2, 3, 4, 5], [50, 51])  # decoding its 7th token at position 6: page 7
    c = seq("c", list(range(20, 28)), [60, PLACEHOLDER])  # its newest id is row 2 of the previous step's samples
    c.pending = PendingToken(row=2, is_last=False)
    sched = step(
        [ScheduledSeq(a, 0, 10), ScheduledSeq(b, 6, 1), ScheduledSeq(c, 9, 1)],
        [SampleRow(a, 0), SampleRow(b, 1), SampleRow(c, 2)],
        [[[3, 5], [7], [2, 4]]],
    )
    x = build_step_inputs(sched, t=16, s=8, page_size=PS, max_blocks=4)
    assert x.token_ids.tolist() == [*range(100, 110), 51, 0, 0, 0, 0, 0]
    assert x.prev_rows.tolist() == [-1] * 11 + [2] + [-1] * 4 and x.has_pending
    assert x.positions.tolist() == [*range(10), 6, 9, 0, 0, 0, 0]
    # slot = page * 8 + position % 8: a's positions 0-7 in page 3, 8-9 in page 5; b's 6 in page 7; c's 9 in page 4
    assert x.slot_mapping.tolist() == [*range(24, 32), 40, 41, 62, 33, -1, -1, -1, -1]
    assert x.kv_lens.tolist() == [10, 7, 10, 0, 0, 0, 0, 0]
    assert x.block_tables.tolist() == [[3, 5, 0, 0], [7, 0, 0, 0], [2, 4, 0, 0]] + [[0, 0, 0, 0]] * 5
    assert x.cu_q_lens.tolist() == [0, 10, 11, 12, 12, 12, 12, 12, 12]
    assert x.num_seqs.tolist() == [3]
    assert x.logits_indices.tolist() == [9, 10, 11, 0, 0, 0, 0, 0]
    assert all(
        arr.dtype == np.int32
        for arr in (
            x.token_ids,
            x.positions,
            x.slot_mapping,
            x.kv_lens,
            x.block_tables,
            x.cu_q_lens,
            x.logits_indices,
            x.prev_rows,
        )
    )


def test_a_prompt_chunk_samples_nothing_and_forked_children_share_the_leaders_row():
    long = seq("l", list(range(40)))
    lead, child = seq("f", [9] * 12, index=0, n=2), seq("f", [9] * 12, index=1, n=2)
    # the first 16 tokens of `long` (a chunk), then `f`'s whole 12-token prompt (its sample 1 forks now)
    sched = step(
        [ScheduledSeq(long, 0, 16), ScheduledSeq(lead, 0, 12)],
        [SampleRow(lead, 1), SampleRow(child, 1)],
        [[[1, 2], [3, 4]]],
    )
    x = build_step_inputs(sched, t=32, s=8, page_size=PS, max_blocks=5)
    assert x.logits_indices.tolist() == [27, 27, 0, 0, 0, 0, 0, 0]  # both rows: the last token of `f`
    assert x.cu_q_lens[:3].tolist() == [0, 16, 28] and x.kv_lens[:2].tolist() == [16, 12]
    assert x.slot_mapping[:16].tolist() == list(range(8, 24))
    assert x.slot_mapping[16:28].tolist() == [*range(24, 32), *range(32, 36)]
    assert (x.slot_mapping[28:] == -1).all() and not x.has_pending


def test_a_hybrids_rerun_tokens_write_no_kv():
    """A re-run after a rejected draft (`ScheduledSeq.rerun`): positions 9-11 are recomputed for the state, read
    from the pages as they are (slot -1: nothing written), the new token at 12 is written and samples."""
    a = seq("a", list(range(10)), [50, 51, 52])
    b = seq("b", [1, 2, 3], [60])
    sched = step(
        [ScheduledSeq(a, 9, 4, rerun=3), ScheduledSeq(b, 3, 1)], [SampleRow(a, 0), SampleRow(b, 1)], [[[3, 5], [7]]]
    )
    x = build_step_inputs(sched, t=8, s=4, page_size=PS, max_blocks=2)
    assert x.token_ids[:5].tolist() == [9, 50, 51, 52, 60] and x.positions[:5].tolist() == [9, 10, 11, 12, 3]
    assert x.slot_mapping.tolist() == [-1, -1, -1, 44, 59, -1, -1, -1]  # page 5 offset 4; page 7 offset 3
    assert x.kv_lens[:2].tolist() == [13, 4] and x.logits_indices[:2].tolist() == [3, 4]


def test_a_step_larger_than_its_buckets_is_refused():
    a = seq("a", list(range(20)))
    with pytest.raises(ValueError, match="does not fit buckets"):
        build_step_inputs(
            step([ScheduledSeq(a, 0, 20)], [SampleRow(a, 0)], [[[1, 2, 3]]]), t=16, s=8, page_size=PS, max_blocks=4
        )


def test_sampling_inputs_rows_flags_bans_and_pending_history():
    greedy = seq("g", [1, 2, 3], [4])
    hot = seq("h", [5, 6], [], index=1, temperature=0.8, top_k=5, min_tokens=2, stop_token_ids=[9], logprobs=1)
    pen = seq("p", [7, 8], [10, PLACEHOLDER], repetition_penalty=1.3)
    pen.pending = PendingToken(row=4, is_last=False)
    rows = [SampleRow(greedy, 0), SampleRow(hot, 1), SampleRow(pen, 2)]
    x = build_sampling_inputs(rows, s=8, suppress_width=8, history_len=16, eos_token_ids=(2, 3))
    assert x.flags == (True, True, True, True)  # do_sample, do_filter, do_penalty, want_logprobs
    m = x.meta
    assert m.temperature.tolist()[:3] == pytest.approx([0.0, 0.8, 0.0]) and m.temperature.shape == (8,)
    assert m.top_k.tolist()[:3] == [0, 5, 0]
    assert m.suppress[1].tolist() == [9, 2, 3, -1, -1, -1, -1, -1]  # under min_tokens: the stop id and EOS
    assert (m.suppress[[0, 2]] == -1).all()
    assert m.seed[1].tolist() == [8, 0]  # the request seed 7 plus sample index 1, as (low, high) words
    assert m.step.tolist()[:3] == [1, 0, 2]
    assert m.history.shape == (8, 16) and m.history[2, :4].tolist() == [7, 8, 10, -1]
    assert (m.history[0] == -1).all() and m.num_prompt.tolist()[:3] == [0, 0, 2]
    assert m.repetition_penalty.tolist()[:3] == pytest.approx([1.0, 1.0, 1.3])
    assert x.pending_rows.tolist() == [-1, -1, 4, -1, -1, -1, -1, -1] and x.pending_cols[2] == 3


def test_a_greedy_step_uses_the_cheapest_sampler_and_no_history():
    rows = [SampleRow(seq("g", [1, 2, 3]), 0)]
    x = build_sampling_inputs(rows, s=8, suppress_width=8, history_len=16, eos_token_ids=(2,))
    assert x.flags == (False, False, False, False) and x.meta.history.shape == (8, 1)


def test_kv_cache_groups_get_one_table_and_slot_mapping_each():
    """Group 1 (a window group) dropped blocks 0 and 1: its row starts at block 2; its tokens' slots are its pages'."""
    a = seq("a", list(range(100, 120)))  # positions 18, 19 computed now, in block 2
    item = ScheduledSeq(a, 18, 2)
    sched = step([item], [SampleRow(a, 0)], [[[3, 5, 6]], [[0, 0, 9]]])
    x = build_step_inputs(sched, t=16, s=8, page_size=PS, max_blocks=4, num_groups=2)
    assert x.block_tables.shape == (2, 8, 4) and x.slot_mapping.shape == (2, 16)
    assert x.block_tables[:, 0].tolist() == [[3, 5, 6, 0], [0, 0, 9, 0]]
    assert x.slot_mapping[:, :3].tolist() == [[50, 51, -1], [74, 75, -1]]
    with pytest.raises(ValueError, match=r"block tables of shape \(2, 1, 3\) for 3 KV groups"):
        build_step_inputs(sched, t=16, s=8, page_size=PS, max_blocks=4, num_groups=3)
    with pytest.raises(ValueError, match="at most 2 blocks"):
        build_step_inputs(sched, t=16, s=8, page_size=PS, max_blocks=2, num_groups=2)
