"""The scheduler alone, on a real KV manager: who runs each step, and the limits it must never break."""

from __future__ import annotations

from paged_jax.kv_cache import KVCacheManager
from paged_jax.sampling_params import SamplingParams
from paged_jax.scheduler import Scheduler
from paged_jax.sequence import FinishReason, Sequence


def request(rid: str, prompt_len: int, n: int = 1, max_tokens: int = 40) -> tuple[Sequence, list[Sequence]]:
    params = SamplingParams(n=n, max_tokens=max_tokens)
    seqs = [Sequence(f"{rid}#{i}", rid, i, list(range(3, 3 + prompt_len)), params, seed=0) for i in range(n)]
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
        for seq, _ in out.sample_rows:  # every sample gets a token and runs on
            seq.append_token(5)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.remove(seq, FinishReason.LENGTH)
        if not (sched.waiting or sched.running):
            break
    assert most == 8 and not (sched.waiting or sched.running)
    kv.check_invariants()
    assert kv.num_free_pages() == 399
