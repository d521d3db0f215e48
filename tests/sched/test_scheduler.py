"""The scheduler alone, on a real KV manager: who runs each step, and the limits it must never break."""

from __future__ import annotations

from paged_jax.kv_cache import KVCacheManager
from paged_jax.kv_cache.invariants import check_manager_invariants
from paged_jax.sampling_params import SamplingParams
from paged_jax.sched.scheduler import Scheduler
from paged_jax.sched.sequence import FinishReason, TokenSequence


def request(rid: str, prompt_len: int, n: int = 1, max_tokens: int = 40) -> tuple[TokenSequence, list[TokenSequence]]:
    params = SamplingParams(n=n, max_tokens=max_tokens)
    seqs = [TokenSequence(f"{rid}#{i}", rid, i, list(range(3, 3 + prompt_len)), params, seed=0) for i in range(n)]
    return seqs[0], seqs[1:]


def test_children_of_a_running_leader_keep_their_slots():
    """An n=8 leader in chunked prefill, then 7 short requests: admission must leave room for the 7 children
    the leader forks when its prompt completes, so `running` never exceeds max_num_seqs."""
    kv = KVCacheManager(num_pages=400, page_size=16)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, chunk_size=16)
    sched.add(*request("big", 190, n=8))
    first = sched.schedule()  # the leader starts its prompt alone
    assert [s.seq.seq_id for s in first.scheduled] == ["big#0"]
    for i in range(7):
        sched.add(*request(f"small{i}", 4))
    most = 0
    for _ in range(200):
        out = sched.schedule()
        assert len(sched.running) <= 8 and len(out.sample_rows) <= 8
        most = max(most, len(sched.running))
        for row in out.sample_rows:  # every sample gets a token and runs on
            seq = row.seq
            seq.append_token(5)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.remove(seq, FinishReason.LENGTH)
        if not (sched.waiting or sched.running):
            break
    assert most == 8 and not (sched.waiting or sched.running)
    check_manager_invariants(kv)
    assert kv.num_free_pages() == 399


def seqs(rid: str, prompt: list[int], n: int = 1) -> tuple[TokenSequence, list[TokenSequence]]:
    params = SamplingParams(n=n, max_tokens=100, temperature=0.0)
    out = [TokenSequence(f"{rid}#{i}", rid, i, list(prompt), params, seed=0) for i in range(n)]
    return out[0], out[1:]


def entries(out) -> list[tuple[str, int, int, list[int]]]:
    """(id, start, new tokens, block table): one group, so the null page 0 only pads past a table's end."""
    tables = out.block_tables[0].tolist()
    return [(s.seq.seq_id, s.start, s.num_new, [p for p in t if p]) for s, t in zip(out.scheduled, tables, strict=True)]


def rows(out) -> list[tuple[str, int]]:
    return [(r.seq.seq_id, r.index) for r in out.sample_rows]


def test_admission_in_arrival_order_and_a_long_prompt_in_chunks():
    """Budget 16: a 20-token prompt runs 16 + 4 tokens; the 5-token one behind it waits for budget, then joins
    the step that completes the first. Pages come off the free list in order (1, 2, 3, ...)."""
    kv = KVCacheManager(num_pages=20, page_size=8)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, watermark=0.0)
    sched.add(*seqs("a", list(range(100, 120))))
    sched.add(*seqs("b", list(range(200, 205))))
    first = sched.schedule()
    assert entries(first) == [("a#0", 0, 16, [1, 2])] and rows(first) == [] and first.num_tokens == 16
    assert [s.seq_id for s in sched.waiting] == ["b#0"]
    second = sched.schedule()
    assert entries(second) == [("a#0", 16, 4, [1, 2, 3]), ("b#0", 0, 5, [4])]
    assert rows(second) == [("a#0", 0), ("b#0", 1)] and second.num_tokens == 9
    assert kv.num_computed_tokens("a#0") == 20 and kv.num_computed_tokens("b#0") == 5
    check_manager_invariants(kv)


def test_chunk_size_caps_one_sequence_per_step():
    kv = KVCacheManager(num_pages=20, page_size=8)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, chunk_size=8, watermark=0.0)
    sched.add(*seqs("a", list(range(20))))
    sched.add(*seqs("b", list(range(50, 53))))
    assert entries(sched.schedule()) == [("a#0", 0, 8, [1]), ("b#0", 0, 3, [2])]
    assert entries(sched.schedule())[0] == ("a#0", 8, 8, [1, 3])


def test_out_of_pages_preempts_the_most_recently_admitted():
    """Four usable pages, three one-page sequences: when they all need a second page, the first gets the last
    free page, and the second takes the page of the third (preempted: back to the front of the waiting queue,
    its pages freed, to be recomputed). No admission in a step that preempted."""
    kv = KVCacheManager(num_pages=5, page_size=8)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, watermark=0.0)
    a, b, c = (seqs(r, [base + i for i in range(7)])[0] for r, base in (("a", 10), ("b", 30), ("c", 50)))
    for s in (a, b, c):
        sched.add(s, [])
    assert entries(sched.schedule()) == [("a#0", 0, 7, [1]), ("b#0", 0, 7, [2]), ("c#0", 0, 7, [3])]
    for _ in range(2):  # position 7 fits the first page; position 8 needs a second one
        for s in (a, b, c):
            s.append_token(s.all_token_ids[-1] + 1)
        out = sched.schedule()
    assert entries(out) == [("a#0", 8, 1, [1, 4]), ("b#0", 8, 1, [2, 3])]
    assert out.preempted == [c] and c.num_preemptions == 1 and sched.num_preemptions == 1
    assert list(sched.waiting) == [c] and "c#0" not in kv and [s.seq_id for s in sched.running] == ["a#0", "b#0"]
    check_manager_invariants(kv)


def test_admission_keeps_the_watermark_free_while_others_run():
    """100 usable pages, 5% watermark: with 92 in use, a request needing 4 more pages (leaving 4 free) waits; one
    needing 2 (leaving 6) is admitted. The first request is always admitted (nothing runs yet)."""

    def run(watermark: float, second_prompt_len: int) -> list[str]:
        kv = KVCacheManager(num_pages=101, page_size=8)
        sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=1024, watermark=watermark)
        sched.add(*seqs("big", [7] * (92 * 8)))
        sched.add(*seqs("small", [8] * second_prompt_len))
        return [s.seq.seq_id for s in sched.schedule().scheduled]

    assert run(0.05, 32) == ["big#0"]
    assert run(0.05, 16) == ["big#0", "small#0"]
    assert run(0.0, 32) == ["big#0", "small#0"]


def test_forked_samples_share_the_prompt_then_copy_on_write():
    """n = 3: the leader computes the 10-token prompt (pages 1, 2) and its two siblings fork on that step,
    sampling from its row. On the next step each writes position 10 into the shared, partly filled page 2:
    the first two writers get private copies (pages 3 and 4), the last one keeps page 2."""
    kv = KVCacheManager(num_pages=10, page_size=8)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, watermark=0.0)
    lead, children = seqs("r", list(range(10)), n=3)
    sched.add(lead, children)
    first = sched.schedule()
    assert entries(first) == [("r#0", 0, 10, [1, 2])]
    assert rows(first) == [("r#0", 0), ("r#1", 0), ("r#2", 0)]
    assert [kv.page_ids(s.seq_id) for s in (lead, *children)] == [[1, 2]] * 3 and kv.page_ref_count(2) == 3
    for i, s in enumerate((lead, *children)):
        s.append_token(50 + i)
    second = sched.schedule()
    assert entries(second) == [("r#0", 10, 1, [1, 3]), ("r#1", 10, 1, [1, 4]), ("r#2", 10, 1, [1, 2])]
    assert second.copy_ops == [(2, 3), (2, 4)] and rows(second) == [("r#0", 0), ("r#1", 1), ("r#2", 2)]
    check_manager_invariants(kv)


def test_admission_round_robin_between_client_requests():
    """Issue 25 item 6: four 8-prompt requests (one group each) then a one-prompt request, two sequences a step:
    the lone prompt is admitted in the third step (fifth in line), not after the 32 prompts before it (it would
    be in the seventeenth). Groups take turns one prompt at a time; without groups admission is arrival order."""
    kv = KVCacheManager(num_pages=200, page_size=8)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64, watermark=0.0)
    for g in "abcd":
        for i in range(8):
            sched.add(*seqs(f"{g}{i}", [7, 8, 9]), group=g)
    sched.add(*seqs("small", [1, 2, 3]))
    assert [s.request_id for s in sched.waiting][:6] == ["a0", "b0", "c0", "d0", "small", "a1"]
    admitted = []
    for _ in range(3):
        out = sched.schedule()
        admitted += [s.seq.request_id for s in out.scheduled]
        for s in list(sched.running):  # every running sequence finishes: two slots free for the next step
            sched.remove(s, FinishReason.LENGTH)
    assert admitted == ["a0", "b0", "c0", "d0", "small", "a1"]
    assert len(sched.waiting) == 32 - 5 and [s.request_id for s in sched.waiting][:4] == ["b1", "c1", "d1", "a2"]
    check_manager_invariants(kv)


def test_waiting_queue_front_goes_before_every_group_and_removal():
    """Preempted (front) sequences go first; removing a group's last waiting sequence drops it from the turns."""
    sched = Scheduler(KVCacheManager(num_pages=50, page_size=8), max_num_seqs=4, max_num_batched_tokens=64)
    a, b, c = (seqs(r, [1, 2])[0] for r in "abc")
    sched.add(a, [], group="g")
    sched.add(b, [], group="g")
    sched.add(c, [])
    sched.waiting.appendleft(seqs("p", [3])[0])
    assert [s.request_id for s in sched.waiting] == ["p", "a", "c", "b"] and len(sched.waiting) == 4
    sched.remove(c, FinishReason.ABORT)
    assert c not in sched.waiting and a in sched.waiting
    assert [sched.waiting.popleft().request_id for _ in range(3)] == ["p", "a", "b"] and not sched.waiting
