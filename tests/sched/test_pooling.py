"""Embedding sequences in the scheduler: each prompt position pooled exactly once across prompt chunks and a
preemption (mean pooling), only the last for last-token pooling, and the prefix cache never read for mean pooling
(another request's longer cached prefix would skip positions not yet pooled)."""

from __future__ import annotations

from paged_jax.kv_cache import KVCacheManager
from paged_jax.kv_cache.invariants import check_manager_invariants
from paged_jax.pooling_params import PoolingParams
from paged_jax.sampling_params import SamplingParams
from paged_jax.sched.scheduler import Scheduler
from paged_jax.sched.sequence import FinishReason, TokenSequence

PROMPT_ONLY = SamplingParams(max_tokens=0, temperature=0.0)


def embedder(rid: str, prompt: list[int], pooling: str) -> TokenSequence:
    return TokenSequence(f"{rid}#0", rid, 0, list(prompt), PROMPT_ONLY, seed=0, pooling=PoolingParams(pooling))


def run(sched: Scheduler, watched: TokenSequence, steps: int = 200) -> list[int]:
    """Step until idle as the engine does: each sample appended, an embedding ended once its last prompt position
    is pooled (it has no sample row); the positions pooled for `watched`, in order."""
    pooled: list[int] = []
    for _ in range(steps):
        out = sched.schedule()
        pooled += [p for item in out.scheduled if item.seq is watched for p in item.pool_positions]
        for item in out.scheduled:
            if item.pool_positions.stop == len(item.seq.prompt_token_ids):
                sched.remove(item.seq, FinishReason.LENGTH)
        assert all(row.seq.pooling is None for row in out.sample_rows)  # an embedding is never sampled
        for row in out.sample_rows:
            seq = row.seq
            seq.append_token(5)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.remove(seq, FinishReason.LENGTH)
        if not (sched.waiting or sched.running):
            break
    return pooled


def test_mean_pools_every_position_once_across_chunks_and_a_preemption():
    kv = KVCacheManager(num_pages=7, page_size=8)  # 48 token slots
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, chunk_size=8, watermark=0.0)
    grower = TokenSequence("g#0", "g", 0, [3, 4, 5, 6], SamplingParams(max_tokens=28, ignore_eos=True), seed=0)
    sched.add(grower, [])
    sched.schedule()  # the generating request runs first, and grows into the pages the embedder holds
    grower.append_token(5)
    seq = embedder("e", list(range(3, 43)), "mean")
    sched.add(seq, [])
    pooled = run(sched, seq)
    assert seq.num_preemptions >= 1  # recomputed from its first token, pooled from where it stopped
    assert pooled == list(range(40))
    check_manager_invariants(kv)
    assert kv.num_free_pages() == 6


def test_last_token_pools_only_the_last_position_and_reads_the_cache():
    kv = KVCacheManager(num_pages=40, page_size=8)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, chunk_size=8)
    prompt = list(range(3, 24))
    first = embedder("a", prompt, "last")
    sched.add(first, [])
    assert run(sched, first) == [20]
    again = embedder("b", prompt, "last")
    sched.add(again, [])
    assert run(sched, again) == [20] and again.num_cached_prompt == 16  # two full blocks from the cache
    mean = embedder("c", prompt, "mean")
    sched.add(mean, [])
    assert run(sched, mean) == list(range(21)) and mean.num_cached_prompt == 0
