"""Warm-up plans every step shape the engine's limits can reach: traffic that drives the shapes found
compiling after warm-up on a server (`copy pages=16`, `forward tokens=32 seqs=64`) compiles nothing.

Before: warm-up compiled one copy bucket (8 pages) and, per token bucket, only the sequence buckets a step
of that many tokens could hold, but a prompt's last chunk samples one row per child of an n > 1 request, so
a 16-token step could need 32 sample rows, and 30 children forking at once 30 page copies.
"""

from __future__ import annotations

import numpy as np

from paged_jax.config.engine import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.sampling_params import SamplingParams
from paged_jax.tokenization.tokenizer import ByteTokenizer
from paged_jax.worker.warmup import GREEDY, WarmupPlan, jobs


def test_reachable_shapes_are_all_warmed_up(tiny_config, tiny_params) -> None:
    ec = EngineConfig(num_pages=256, max_num_seqs=32, max_num_batched_tokens=32, attention_backend="xla", warmup=False)
    engine = LLMEngine(tiny_config, tiny_params, ByteTokenizer(), ec)
    plan = WarmupPlan(sampler_flags=(GREEDY,), lookahead=ec.async_scheduling)  # greedy traffic only
    engine.warmup(plan, progress=False)
    compiled = engine.stats().compile_count
    assert compiled == len(jobs(engine.runner, plan))
    rng = np.random.default_rng(0)
    greedy = dict(temperature=0.0, ignore_eos=True)
    waves = [
        [("ab", SamplingParams(n=16, max_tokens=3, **greedy))] * 2,  # 2 x 16 rows after 4 tokens; 30 forks at once
        [("abcdefghijklmnopqrstu", SamplingParams(n=8, max_tokens=2, **greedy))] * 4,
        [
            (bytes(rng.integers(97, 123, int(k))).decode(), SamplingParams(max_tokens=int(m), **greedy))
            for k, m in zip(rng.integers(1, 60, 24), rng.integers(1, 12, 24), strict=True)
        ],
    ]
    for w, wave in enumerate(waves):
        for i, (prompt, params) in enumerate(wave):
            engine.add_request(f"r{w}-{i}", prompt, params)
        while engine.has_unfinished():
            engine.step()
    stats = engine.stats()
    assert stats.compiles_after_warmup == 0, engine.runner.compile_stats
    assert stats.compile_count == compiled
    assert stats.pages_free == stats.pages_total
