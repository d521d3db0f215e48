"""Swap on preemption end to end (`paged_jax.kv_cache.swap`): a tight page budget preempts requests; with a host
tier their pages go to host memory and come back, and every request's greedy tokens (and logprobs, to float32
rounding: batches of other shapes) are those of the same request never preempted and of the recompute policy,
with fewer tokens computed. The cost model picks the cheaper policy; an aborted swapped request returns its host
slots; a step's host -> device copies stay within the restore budget; speculative decoding and LoRA adapters
over both tiers give the cold tokens. Invariants (pages, tier slots, swap reservations) hold after every step and
everything is free at the end."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.kv_cache import SwapCosts
from paged_jax.sampling_params import SamplingParams

from support.engines import make_engine
from support.lora_adapters import lora_engine, make_tiny_adapters
from support.lora_adapters import serve as lora_serve

LOGPROBS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
TIGHT = {"num_pages": 14}  # 13 usable pages = 208 token slots for eight requests of up to ~100 tokens
TIER = {"kv_host_cache_gib": 0.01}


def prompts(seed: int, n: int = 8, lo: int = 20, hi: int = 90, shared: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 259, shared).tolist()
    return [prefix + rng.integers(3, 259, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def run(engine: LLMEngine, ps: list[list[int]], params: SamplingParams = LOGPROBS, on_step=None) -> dict:
    """One request per step; returns id -> (tokens, logprobs). Invariants after every step, all free at the end."""
    pending, results = list(enumerate(ps)), {}
    while pending or engine.has_unfinished():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = (
                    out.outputs[0].token_ids,
                    [lp.logprob for lp in out.outputs[0].logprobs or []],
                )
        engine.check_invariants()
        if on_step is not None:
            on_step(engine)
    assert_all_back(engine)
    return results


def assert_all_back(engine: LLMEngine) -> None:
    st = engine.stats()
    assert st.pages_in_use == 0 and st.pages_free == st.pages_total  # every page back
    assert st.kv_host_swap_pages_held == 0  # every swap slot back
    if engine.host_tier is not None:
        engine.host_tier.check()
        assert not engine.host_tier.reserved and not engine.scheduler.swap.swapped


def same(got: dict, want: dict) -> None:
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    for k in want:
        np.testing.assert_allclose(got[k][1], want[k][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "options",
    [
        {},
        pytest.param({"async_scheduling": False}, marks=pytest.mark.slow),
        pytest.param({"chunk_size": 16}, marks=pytest.mark.slow),
    ],
    ids=["async", "sync", "chunk16"],
)
def test_swapped_requests_resume_exactly(tiny_config, tiny_params, options):
    ps = prompts(2)
    never_engine = make_engine(tiny_config, tiny_params, **TIGHT, max_num_seqs=1, **options)  # one at a time: fits
    never = run(never_engine, ps)
    recompute_engine = make_engine(tiny_config, tiny_params, **TIGHT, **options)
    recompute = run(recompute_engine, ps)
    swap_engine = make_engine(tiny_config, tiny_params, **TIGHT, **TIER, kv_preemption_mode="swap", **options)
    swapped = run(swap_engine, ps)
    same(swapped, never)
    same(recompute, never)
    st, rc = swap_engine.stats(), recompute_engine.stats()
    assert not never_engine.stats().num_preemptions
    assert rc.num_preemptions > 0 and rc.kv_host_swap_outs == 0
    assert st.num_preemptions == st.kv_host_swap_outs == st.kv_host_swap_ins > 0  # every preemption swapped
    assert st.kv_host_swap_bytes_to_host == st.kv_host_swap_bytes_to_device > 0
    assert st.kv_host_swap_bytes_to_host % swap_engine.host_tier.page_bytes == 0
    assert st.step_tokens < rc.step_tokens  # nothing recomputed


def test_cost_model_picks_the_cheaper_policy(tiny_config, tiny_params):
    costs = SwapCosts(
        copy_bytes_per_s=1e9, flops_per_s=1e12, flops_per_token=2e9, attention_flops=0.0, page_bytes=1 << 20
    )
    assert costs.swap_seconds(10) == pytest.approx(2 * 10 * 2**20 / 1e9)
    assert costs.recompute_seconds(160, 160) == pytest.approx(160 * 2e9 / 1e12)
    assert costs.prefer_swap(10, 160, 160)  # 21 ms of copies vs 320 ms of prefill
    assert not costs.prefer_swap(10, 8, 8)  # vs 16 ms: a short context recomputes
    with_attention = dataclasses.replace(costs, attention_flops=1e6)
    assert with_attention.recompute_seconds(10, 110) == pytest.approx((10 * 2e9 + 1e6 * (10 * 100 + 55)) / 1e12)
    ps = prompts(2)
    for copy_rate, swaps in ((1e3, False), (1e15, True)):  # copies slower / faster than any recompute
        engine = make_engine(tiny_config, tiny_params, **TIGHT, **TIER)
        swap = engine.scheduler.swap
        assert swap is not None and swap.mode == "auto"
        swap.costs = dataclasses.replace(swap.costs, copy_bytes_per_s=copy_rate)
        run(engine, ps)
        st = engine.stats()
        assert st.num_preemptions > 0 and (
            st.kv_host_swap_outs == st.num_preemptions if swaps else not st.kv_host_swap_outs
        )
    recompute = make_engine(tiny_config, tiny_params, **TIGHT, **TIER, kv_preemption_mode="recompute")
    assert recompute.scheduler.swap is None


def test_an_aborted_swapped_request_returns_its_slots(tiny_config, tiny_params):
    engine = make_engine(tiny_config, tiny_params, **TIGHT, **TIER, kv_preemption_mode="swap")
    swap = engine.scheduler.swap
    for i, p in enumerate(prompts(3)):
        engine.add_request(f"r{i}", p, LOGPROBS)
    while not swap.swapped:
        engine.step()
        engine.check_invariants()
    victim = next(iter(swap.swapped))
    held = len(swap.swapped[victim].slots)
    assert held > 0 and engine.stats().kv_host_swap_pages_held == held
    engine.abort(victim.split("#")[0])
    engine.check_invariants()
    assert victim not in swap.swapped and engine.stats().kv_host_swap_pages_held == len(engine.host_tier.reserved)
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    assert_all_back(engine)


def record_restores(engine: LLMEngine) -> list[list[int]]:
    """Wrap the scheduler: per step, the host -> device page copies of each scheduled request that has some."""
    steps, schedule = [], engine.scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        t = out.kv_transfers
        dest = set() if t is None else {c.page for c in t.restores} | {load.page for load in t.loads}
        per = [int(np.isin(out.block_tables[:, i], list(dest)).sum()) for i in range(len(out.scheduled))]
        steps.append([n for n in per if n])
        return out

    engine.scheduler.schedule = recording
    return steps


def test_restores_stay_within_the_step_budget(tiny_config, tiny_params):
    """Prefix blocks the host tier holds and swapped requests' pages count against the restore budget (pages):
    a step copies at most the budget, but for the first request it admits, which always goes."""
    ps = prompts(4, n=10, lo=10, hi=40, shared=48)
    runs = []
    for budget in (1000, 3):
        engine = make_engine(tiny_config, tiny_params, **TIGHT, **TIER, kv_restore_pages_per_step=budget)
        steps = record_restores(engine)
        runs.append((run(engine, ps + ps), steps, engine.stats()))
    (free, free_steps, free_st), (tight, tight_steps, tight_st) = runs
    same(tight, free)
    assert free_st.kv_host_hits > 0 and tight_st.kv_host_hits > 0
    assert max(sum(s) for s in free_steps) > 3  # unbounded, some step copies more
    for step in tight_steps:
        assert sum(step) <= 3 or len(step) == 1, step
    assert sum(map(len, tight_steps)) >= sum(map(len, free_steps))


def conversations(seed: int, n: int = 6) -> list[list[int]]:
    """Turns that share a 48-token prefix, then repeat: the second round finds the first's blocks evicted."""
    ps = prompts(seed, n=n, lo=20, hi=50, shared=48)
    return ps + ps


def test_speculative_decoding_over_the_tiers_gives_the_cold_tokens(tiny_config, tiny_params):
    ps = conversations(5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    cold = run(make_engine(tiny_config, tiny_params, **TIGHT, enable_prefix_caching=False), ps, params)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    engine = make_engine(tiny_config, tiny_params, **TIGHT, **TIER, speculative_config=spec, kv_preemption_mode="swap")
    got = run(engine, ps, params)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in cold.items()}
    st = engine.stats()
    assert st.spec_draft_tokens > 0 and st.kv_host_hits > 0 and st.kv_host_swap_outs > 0


def test_lora_adapters_key_the_tiers_apart(tmp_path):
    """The same prompts under two adapters and the base model: each request's tokens are its own cold ones, though
    the tier holds (and restores) blocks of the same tokens under every adapter."""
    adapters = make_tiny_adapters(tmp_path)
    a, b = adapters["all"], adapters["mlp"]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    requests = [
        (f"r{j}.{i}", p, params, lora)
        for i, p in enumerate(conversations(6, n=3))
        for j, lora in enumerate((a, b, None))
    ]
    cold = lora_serve(lora_engine(**TIGHT, max_num_seqs=4, enable_prefix_caching=False), requests)
    engine = lora_engine(**TIGHT, **TIER, max_num_seqs=4, kv_preemption_mode="swap")
    got = lora_serve(engine, requests)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in cold.items()}
    for k in cold:
        np.testing.assert_allclose(got[k][1], cold[k][1], rtol=1e-5, atol=1e-5)
    assert len({tuple(cold[f"r{j}.0"][0][0]) for j in range(3)}) == 3  # the adapters change the tokens
    st = engine.stats()
    assert st.kv_host_hits > 0 and st.num_preemptions > 0
    engine.check_invariants()
    assert_all_back(engine)
