"""Hybrid KV memory end to end: the tiny Gemma 2 and Gemma 3 (sliding window 4, pages of 8, so windows cross page
edges) run with KV cache groups, their window groups' tables dropping the pages no query reads, and give the tokens
of transformers (the stored goldens) and of the dense reference (`greedy_generate`, itself checked against
transformers' logits in tests/model/test_families.py) on prompts many windows long: chunked prefill across window
edges, prefix hits beyond the window, preemption under a small page budget, n = 4 forks and n-gram speculation.
The KV manager's invariants are checked after every step and every page is free at the end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from paged_jax.engine.load import load_model
from paged_jax.model.families import causal_lm
from paged_jax.model.reference import greedy_generate
from paged_jax.model.scan import stack_layers
from paged_jax.offline.llm import LLM
from paged_jax.sampling_params import SamplingParams

DATA = Path(__file__).parents[1] / "data"
WINDOW = 4
DROPPED = [0]  # the most window blocks dropped from running requests' tables at once, over the `run`s so far


def make_llm(name: str, **options) -> LLM:
    kwargs = dict(
        dtype="float32",
        attention_backend="xla",
        page_size=8,
        num_pages=96,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        chunk_size=8,
        warmup=False,
        scan_layers="on",
    )
    return LLM(str(DATA / f"hf_{name}"), **(kwargs | options))


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, salt: str | None = None) -> list[list[list[int]]]:
    """Every request to the end, the invariants checked after each step; each request's samples' tokens."""
    engine = llm.engine
    base = engine.num_steps
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{base}.{i}", prompt, params, cache_salt=salt)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [list(c.token_ids) for c in out.outputs]
        engine.check_invariants()
        DROPPED[0] = max(DROPPED[0], sum(sum(st.dropped) for st in engine.kv.requests.values()))
    engine.check_invariants()
    st = engine.kv.stats()
    assert st.pages_in_use == 0 and st.pages_free == st.pages_total  # every page back
    return [done[f"r{base}.{i}"] for i in range(len(prompts))]


def golden(name: str) -> list[tuple[list[int], list[int]]]:
    data = np.load(DATA / f"hf_{name}" / "golden.npz")
    count = len([k for k in data.files if k.startswith("prompt_")])
    return [(data[f"prompt_{i}"].tolist(), data[f"greedy_{i}"].tolist()) for i in range(count)]


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def family(request):
    name = request.param
    config, params, _ = load_model(DATA / f"hf_{name}", dtype="float32")
    model, stacked = causal_lm(config, scan_layers=True), stack_layers(params)
    rng = np.random.default_rng(0)
    long = [rng.integers(3, config.vocab_size, size=n).tolist() for n in (37, 61)]  # 9 and 15 windows

    def reference(prompt: list[int], n: int) -> list[int]:
        return greedy_generate(model, stacked, prompt, n, pad_to=128)

    return name, make_llm(name), long, reference


def test_layout_has_window_groups_and_the_step_reads_them(family):
    name, llm, _, _ = family
    engine = llm.engine
    assert engine.kv.num_groups > 1 and engine.runner.grouped is not None
    assert WINDOW in engine.kv.windows and None in [g.window for g in engine.kv.groups]
    # The stacked cache is slots_per_page slabs of num_pages pages, not num_layers.
    slabs = engine.kv_layout.slots_per_page
    assert slabs < llm.engine.config.num_layers
    assert engine.runner.kv_caches.shape[0] == slabs * engine.num_pages


def test_greedy_matches_hf_and_the_dense_reference_on_long_prompts(family):
    name, llm, long, reference = family
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    gold = golden(name)
    assert [o[0] for o in run(llm, [p for p, _ in gold], params)] == [g for _, g in gold]
    want = [reference(p, 16) for p in long]
    DROPPED[0] = 0
    assert [o[0] for o in run(llm, long, params)] == want
    assert DROPPED[0] >= 8  # the window groups' tables lost the pages their window no longer reads


def test_prefix_hit_beyond_the_window_is_exact(family):
    _, llm, long, reference = family
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = run(llm, [long[1]], params, salt="turns")[0][0]
    # The next turn: the first turn's prompt and answer, then more; its hit reaches far past the window.
    turn = long[1] + first + long[0][:11]
    before = llm.engine.kv.stats().prefix_hits
    assert run(llm, [turn], params, salt="turns")[0][0] == reference(turn, 8)
    assert llm.engine.kv.stats().prefix_hits - before >= 64


def test_preemption_under_a_small_budget(family):
    name, _, long, reference = family
    llm = make_llm(name, num_pages=24, max_num_batched_tokens=32, chunk_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [long[0], long[1], long[0][5:], long[1][7:]]
    assert [o[0] for o in run(llm, prompts, params)] == [reference(p, 12) for p in prompts]
    assert llm.engine.stats().num_preemptions > 0


def test_n4_forks_and_ngram_speculation_match_full_length_pages(family):
    name, llm, long, reference = family
    sampled = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    full = make_llm(name, hybrid_kv=False)
    assert full.engine.kv.num_groups == 1
    assert run(llm, [long[1]], sampled) == run(full, [long[1]], sampled)
    spec = make_llm(name, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    repeat = long[0][:12] * 4  # n-grams to match, so drafts are proposed and some kept
    assert [o[0] for o in run(spec, [repeat, long[1]], greedy)] == [reference(repeat, 16), reference(long[1], 16)]
    assert spec.engine.stats().spec_draft_tokens > 0
