"""The host tier end to end: multi-turn conversations sharing a system prompt on a device budget that holds about
two of them, so each turn finds its earlier turns evicted. With the tier on, the evicted blocks come back from host
memory instead of being recomputed, and every token is the same as with the tier off and as with no prefix cache at
all (float, int8 pages with their scales, n > 1 forks that copy on write, a sliding-window model's KV cache
groups). Invariants are checked after every step, every page is free at the end and the tier's slots are
consistent; the copy executables stop growing once the workload is steady."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.offline.llm import LLM
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.kv_transfer import COPY_BUCKETS

from support.engines import make_engine

DATA = Path(__file__).parents[1] / "data"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def conversations(seed: int, n: int, system: int, user: int, vocab: int = 250) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, vocab, system).tolist()
    return [prefix + rng.integers(3, vocab, user).tolist() for _ in range(n)]


def turns(engine: LLMEngine, first: list[list[int]], params: SamplingParams, num_turns: int, seed: int = 1):
    """`num_turns` rounds: every conversation's next prompt is its last prompt, its first sample and a new user
    message. Returns every request's samples, in order."""
    rng = np.random.default_rng(seed)
    prompts, out = [list(p) for p in first], []
    for _ in range(num_turns):
        base = engine.num_steps
        for i, prompt in enumerate(prompts):
            engine.add_request(f"t{base}.{i}", prompt, params)
        done: dict[str, list[list[int]]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = [list(c.token_ids) for c in o.outputs]
            engine.check_invariants()
        got = [done[f"t{base}.{i}"] for i in range(len(prompts))]
        out.append(got)
        prompts = [p + g[0] + rng.integers(3, 250, 7).tolist() for p, g in zip(prompts, got, strict=True)]
    st = engine.stats()
    assert st.pages_in_use == 0 and st.pages_free == st.pages_total  # every page back
    if engine.host_tier is not None:
        engine.host_tier.check()
        assert st.kv_host_pages_held == len(engine.host_tier) <= st.kv_host_pages_capacity
    return out


@pytest.fixture
def run3(tiny_config, tiny_params):
    def run(num_turns: int = 2, params: SamplingParams = GREEDY, cold: bool = False, **options):
        """(tier-on engine, tier-off engine, outputs of on, off and, with `cold`, no prefix cache)."""
        convs = conversations(0, 6, system=40, user=50)
        kw = dict(num_pages=20, max_num_seqs=2) | options
        on = make_engine(tiny_config, tiny_params, kv_host_cache_gib=0.01, **kw)
        off = make_engine(tiny_config, tiny_params, kv_host_cache_gib=0, **kw)
        engines = [on, off] + (
            [make_engine(tiny_config, tiny_params, enable_prefix_caching=False, **kw)] if cold else []
        )
        outs = [turns(e, convs, params, num_turns) for e in engines]
        return on, off, outs

    return run


def test_restores_replace_recompute_with_identical_tokens(run3):
    on, off, (with_tier, without, cold) = run3(cold=True)
    assert with_tier == without == cold
    s_on, s_off = on.stats(), off.stats()
    assert s_on.kv_host_hits > 0 and s_on.kv_host_offloads > 0 and s_on.prefix_hits_host > 0
    assert s_on.prefix_hits == s_off.prefix_hits + s_on.prefix_hits_host  # the host tier adds to the device's hits
    assert on.runner.real_tokens == off.runner.real_tokens - s_on.prefix_hits_host  # served, not recomputed
    assert s_on.kv_host_bytes_to_host > 0 and s_on.kv_host_bytes_to_device > 0
    assert s_off.kv_host_pages_capacity == 0 and off.runner.kv_transfer is None
    # steady state: more turns of the same workload compile no further copy executables
    transfer = on.runner.kv_transfer
    assert transfer is not None and 0 < transfer.compile_count <= 2 * len(COPY_BUCKETS)  # the module's first
    before = transfer.compile_count
    turns(on, conversations(5, 6, system=40, user=50), GREEDY, 2)
    assert transfer.compile_count == before


@pytest.mark.slow
def test_int8_pages_restore_with_their_scales(run3):
    on, _, (with_tier, without) = run3(kv_dtype="int8")
    assert with_tier == without
    assert on.stats().kv_host_hits > 0
    assert [a.dtype for a in on.host_tier.arrays] == [np.dtype(np.int8), np.dtype(np.float32)] * (
        len(on.host_tier.arrays) // 2
    )


@pytest.mark.slow
def test_forks_copy_on_write_over_restored_pages(run3):
    sampled = SamplingParams(temperature=0.9, max_tokens=5, ignore_eos=True, n=3, seed=7)
    on, _, (with_tier, without) = run3(params=sampled, max_num_seqs=6, num_pages=28)
    assert with_tier == without
    assert on.stats().kv_host_hits > 0


def gemma3(**options) -> LLMEngine:
    """The tiny Gemma 3 of tests/engine/test_hybrid_kv.py (window 4, pages of 8): 1 full + window groups."""
    kwargs = dict(dtype="float32", attention_backend="xla", page_size=8, max_num_batched_tokens=16, chunk_size=8)
    return LLM(str(DATA / "hf_gemma3"), warmup=False, scan_layers="on", **(kwargs | options)).engine


@pytest.mark.slow
def test_sliding_window_groups_restore_per_group():
    convs = conversations(3, 4, system=40, user=40, vocab=200)
    on = gemma3(num_pages=36, max_num_seqs=2, kv_host_cache_gib=0.01)
    off = gemma3(num_pages=36, max_num_seqs=2, kv_host_cache_gib=0)
    assert on.kv.num_groups > 1
    assert turns(on, convs, GREEDY, 3) == turns(off, convs, GREEDY, 3)
    assert on.stats().kv_host_hits > 0
