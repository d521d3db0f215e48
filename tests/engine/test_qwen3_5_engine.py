"""Qwen3.5 (Gated DeltaNet + gated full attention, dense and MoE) served by the paged engine, against transformers'
goldens (tests/data/hf_qwen3_5, hf_qwen3_5_moe): the linear layers' conv and recurrent states live in the
recurrent-state pool, one slot per running sequence, carried between steps and between prefill chunks of odd
sizes, in steps that mix prefill chunks and decodes; preemption under a small page budget frees the slot and
recomputes; n = 4 forks copy the leader's slot once. Every step checks the KV manager's and the slots'
invariants, and every page and slot is free at the end."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.config import ConfigError
from paged_jax.offline.llm import LLM
from paged_jax.sampling_params import SamplingParams

from support.hf_golden import DATA, load_golden

VARIANTS = ("qwen3_5", "qwen3_5_moe")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def make_llm(name: str, **options) -> LLM:
    kwargs = dict(
        dtype="float32",
        page_size=8,
        num_pages=64,
        max_num_seqs=4,
        max_num_batched_tokens=7,
        chunk_size=5,  # odd chunks: a prompt's state crosses scheduler chunks at positions 5, 10, 15, 20
        warmup=False,
    )
    return LLM(str(DATA / f"hf_{name}"), **(kwargs | options))


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, kinds: list[str] | None = None):
    """Every request to the end, the invariants checked after each step; each request's samples' tokens.
    `kinds`: collects "mixed" for each step that ran prefill chunks beside decodes."""
    return [[list(c.token_ids) for c in out.outputs] for out in run_outputs(llm, prompts, params, kinds)]


def run_outputs(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, kinds: list[str] | None = None, salt: str | None = None
):
    """`run`, returning each request's final `RequestOutput` (`salt`: every request's cache salt)."""
    engine = llm.engine
    base = engine.num_steps
    schedule = engine.scheduler.schedule

    def spy(*args, **kwargs):
        out = schedule(*args, **kwargs)
        decodes = [s for s in out.scheduled if s.num_new == 1 and s.start >= len(s.seq.prompt_token_ids)]
        if kinds is not None and decodes and len(decodes) < len(out.scheduled):
            kinds.append("mixed")
        return out

    engine.scheduler.schedule = spy
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{base}.{i}", prompt, params, cache_salt=salt)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            engine.check_invariants()
    finally:
        engine.scheduler.schedule = schedule
    engine.check_invariants()
    st = engine.kv.stats()
    assert st.pages_in_use == 0 and st.pages_free == st.pages_total  # every page back
    slots = engine.scheduler.state_slots
    assert slots is not None and slots.num_in_use == 0 and slots.num_free == slots.num_slots - 1  # every slot back
    return [done[f"r{base}.{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request):
    name = request.param
    return name, make_llm(name), load_golden(DATA / f"hf_{name}")


def test_greedy_matches_hf_in_mixed_chunked_steps(variant):
    name, llm, golden = variant
    kinds: list[str] = []
    got = run(llm, [p.tolist() for p, _, _ in golden], GREEDY, kinds)
    assert [g[0] for g in got] == [g.tolist() for _, _, g in golden], name
    assert "mixed" in kinds  # some step ran a prompt chunk beside decodes


def test_prompt_logprobs_match_hf(variant):
    """Every prompt position's logprob (read from the paged step's logits, chunk by chunk) within 1e-4 of
    transformers' float32 logits."""
    name, llm, golden = variant
    prompt, logits, _ = golden[2]  # 23 tokens: five chunks
    out = llm.generate([{"prompt_token_ids": prompt.tolist()}], SamplingParams(max_tokens=1, prompt_logprobs=0))
    got = np.array([lp.logprob for lp in out[0].prompt_logprobs[1:]])
    x = logits[:-1].astype(np.float64)
    ref = x - x.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    want = ref[np.arange(len(prompt) - 1), prompt[1:]]
    assert np.abs(got - want).max() < 1e-4, name


def test_preemption_frees_the_slot_and_recomputes(variant):
    name, _, golden = variant
    llm = make_llm(name, num_pages=8, max_num_batched_tokens=16, chunk_size=16)  # 7 pages: 56 tokens
    got = run(llm, [p.tolist() for p, _, _ in golden], GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0, name
    assert [g[0] for g in got] == [g.tolist() for _, _, g in golden], name


def test_n4_forks_copy_the_leaders_state(variant):
    name, llm, golden = variant
    prompt, _, greedy = golden[1]
    (samples,) = run(llm, [prompt.tolist()], SamplingParams(temperature=0.0, max_tokens=16, n=4))
    assert samples == [greedy.tolist()] * 4, name


def test_what_the_family_does_not_support_is_refused_by_name():
    with pytest.raises(ConfigError, match="^kv_host_cache_gib: .*'qwen3_5'"):
        make_llm("qwen3_5", kv_host_cache_gib=0.01)
    with pytest.raises(ConfigError, match="^scan_layers: .*'qwen3_5'"):
        make_llm("qwen3_5", scan_layers="on")


def test_prefix_hits_at_several_depths_equal_the_cold_computation(variant):
    """Snapshots every 16 tokens and at each prompt's last full block (pages of 8): prompts sharing 20, 36 and 45
    tokens with an earlier one hit its snapshots at 16, 32 and 40 and give the cold engine's tokens; a one-token
    difference at position 2 misses, one at position 20 hits only the snapshot below it, another cache salt misses."""
    name, _, _ = variant
    warm = make_llm(name, state_snapshot_interval=16, state_snapshots=16, max_num_batched_tokens=16, chunk_size=16)
    cold = make_llm(name, enable_prefix_caching=False, max_num_batched_tokens=16, chunk_size=16)
    rng = np.random.default_rng(1)
    base = rng.integers(3, 288, size=45).tolist()
    tails = [rng.integers(3, 288, size=n).tolist() for n in (3, 5, 2)]
    near = [base[:2] + [(base[2] + 1) % 288] + base[3:], base[:20] + [(base[20] + 1) % 288] + base[21:]]
    prompts = [base[:20] + tails[0], base[:36] + tails[1], base + tails[2], base, *near]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    run_outputs(warm, [base], params)
    got = run_outputs(warm, prompts, params)
    assert [o.metrics.num_cached_prompt_tokens for o in got] == [16, 32, 40, 40, 0, 16], name
    want = run(cold, prompts, params)
    assert [[list(c.token_ids) for c in o.outputs] for o in got] == want, name
    (salted,) = run_outputs(warm, [base], params, salt="another tenant")  # the salt is in every block's hash
    assert salted.metrics.num_cached_prompt_tokens == 0
    stats = warm.engine.stats()
    assert stats.state_snapshot_hits == 5 and stats.state_snapshots_cached > 0 and stats.state_slots_in_use == 0


def test_one_budget_the_state_pool_first_then_pages_of_full_layers():
    """Without `num_pages` the CPU budget pays for the state pool (slots and snapshot rows, what the runner
    allocates) and the rest buys pages of the full-attention layers only; the cap at what `max_num_seqs`
    sequences can hold counts pages alone."""
    from paged_jax.model.linear_state import LinearState
    from paged_jax.model.quant import kv_bytes_per_page
    from paged_jax.worker.linear_state import state_pool_bytes

    budget = 2**18  # under the cap: 4 sequences x 32 blocks + the null page = 129 pages of 2 KiB
    llm = make_llm("qwen3_5", num_pages=None, cpu_kv_cache_bytes=budget, max_model_len=256)
    engine = llm.engine
    config = engine.config
    pool = sum(x.nbytes for c in engine.runner.kv_caches if isinstance(c, LinearState) for x in (c.conv, c.recurrent))
    assert pool == state_pool_bytes(config, 4, 4) > 0  # 4 slots, the null slot, 4 snapshot rows
    page = kv_bytes_per_page(config, np.float32, 8, num_slabs=config.num_kv_layers)
    assert engine.num_pages == (budget - pool) // page
    assert engine.kv_cache_bytes == engine.num_pages * page  # pages only for the one full-attention layer
    capped = make_llm("qwen3_5", num_pages=None, cpu_kv_cache_bytes=2**21, max_model_len=256).engine
    assert capped.num_pages == 4 * 32 + 1  # the state came off the budget before the cap, not after
