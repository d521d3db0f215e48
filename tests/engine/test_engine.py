"""The engine against the dense model: paging, chunking, prefix caching and preemption change where KV lives,
never the tokens. Every test ends with every page free and the KV manager's invariants intact."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.kv_cache.invariants import check_manager_invariants
from paged_jax.model.llama import LlamaForCausalLM
from paged_jax.model.reference import greedy_generate
from paged_jax.sampling_params import SamplingParams
from paged_jax.tokenization.tokenizer import ByteTokenizer
from paged_jax.worker.executables import persistent_cache_summary
from paged_jax.worker.sampler import sample

from support.engines import make_engine

MAX_TOKENS = 12


def make_prompts(n: int, seed: int, max_len: int = 150, shared_prefix: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 259, shared_prefix).tolist()
    return [prefix + rng.integers(3, 259, int(rng.integers(1, max_len))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_config, tiny_params):
    model = LlamaForCausalLM(tiny_config)
    cache: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            cache[key] = greedy_generate(model, tiny_params, prompt, MAX_TOKENS, eos=tiny_config.eos_token_ids)
        return cache[key]

    return greedy


def run_workload(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | None = None, arrive_every: int = 2
) -> dict[str, list[int]]:
    """Requests arrive one every `arrive_every` steps; returns each request's tokens."""
    params = params or SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    pending = list(enumerate(prompts))
    results: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % arrive_every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        check_manager_invariants(engine.kv)
        step += 1
    assert_all_free(engine)
    return results


def assert_all_free(engine: LLMEngine) -> None:
    check_manager_invariants(engine.kv)
    stats = engine.kv.stats()
    assert stats.pages_in_use == 0, stats
    assert stats.pages_free == stats.pages_total


def check_against_reference(results, prompts, reference) -> None:
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"] == reference(prompt), f"request r{i} (prompt length {len(prompt)})"


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"page_size": 8, "num_pages": 192},
        {"page_size": 64, "num_pages": 24},
        {"chunk_size": 16},
        {"chunk_size": 64, "max_num_batched_tokens": 128},
        {"enable_prefix_caching": False},
    ],
    ids=["default", "page8", "page64", "chunk16", "chunk64", "no-prefix-cache"],
)
def test_greedy_matches_dense_model(tiny_config, tiny_params, reference, options):
    engine = make_engine(tiny_config, tiny_params, **options)
    prompts = make_prompts(10, seed=1)
    check_against_reference(run_workload(engine, prompts), prompts, reference)


def test_preemption_under_a_tiny_kv_budget(tiny_config, tiny_params, reference):
    engine = make_engine(tiny_config, tiny_params, num_pages=14)  # 13 usable pages = 208 token slots
    prompts = make_prompts(8, seed=2, max_len=90)
    results = run_workload(engine, prompts, arrive_every=1)
    assert engine.stats().num_preemptions > 0
    check_against_reference(results, prompts, reference)


def test_prefix_cache_hits_are_counted_and_exact(tiny_config, tiny_params, reference):
    engine = make_engine(tiny_config, tiny_params)
    prompts = make_prompts(6, seed=3, max_len=20, shared_prefix=64)
    results = run_workload(engine, prompts, arrive_every=4)
    check_against_reference(results, prompts, reference)
    stats = engine.kv.stats()
    assert stats.prefix_hits > 0 and stats.prefix_hit_rate > 0
    # A fully cached prompt still computes its last token.
    engine.add_request("again", prompts[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].outputs[0].token_ids == reference(prompts[0])
    assert outs[0].metrics.num_cached_prompt_tokens == (len(prompts[0]) - 1) // 16 * 16
    assert_all_free(engine)


def test_pallas_interpret_backend_matches(tiny_config, tiny_params, reference):
    engine = make_engine(tiny_config, tiny_params, attention_backend="pallas-interpret")
    prompts = make_prompts(3, seed=4, max_len=40)
    check_against_reference(run_workload(engine, prompts), prompts, reference)


def test_parallel_samples_share_the_prompt(tiny_config, tiny_params, reference):
    engine = make_engine(tiny_config, tiny_params)
    prompt = make_prompts(1, seed=5, max_len=40)[0]
    engine.add_request("greedy", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS))
    engine.add_request("sampled", prompt, SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True))
    finished = {}
    while engine.has_unfinished():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
        check_manager_invariants(engine.kv)
    assert [c.token_ids for c in finished["greedy"].outputs] == [reference(prompt)] * 3
    sampled = [tuple(c.token_ids) for c in finished["sampled"].outputs]
    assert len(set(sampled)) > 1 and all(len(s) == 8 for s in sampled)
    assert_all_free(engine)


def test_seeded_request_is_independent_of_the_batch(tiny_config, tiny_params):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    prompt = make_prompts(1, seed=6)[0]
    alone = make_engine(tiny_config, tiny_params)
    alone.add_request("x", prompt, params)
    crowd = make_engine(tiny_config, tiny_params)
    for i, other in enumerate(make_prompts(5, seed=7)):
        crowd.add_request(f"o{i}", other, SamplingParams(temperature=1.0, max_tokens=10))
    crowd.add_request("x", prompt, params)

    def tokens(engine):
        got = None
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == "x" and o.finished:
                    got = o.outputs[0].token_ids
        return got

    assert tokens(alone) == tokens(crowd)


def test_stop_conditions(tiny_config, tiny_params, reference):
    engine = make_engine(tiny_config, tiny_params)
    prompt = make_prompts(1, seed=8, max_len=30)[0]
    ref = reference(prompt)

    def run(params):
        engine.add_request("s", prompt, params)
        final = None
        while engine.has_unfinished():
            final = next((o for o in engine.step() if o.finished), final)
        assert_all_free(engine)
        return final.outputs[0]

    out = run(SamplingParams(temperature=0.0, max_tokens=5))
    assert out.token_ids == ref[:5] and out.finish_reason == "length"
    out = run(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[ref[3]]))
    assert out.token_ids == ref[: ref.index(ref[3]) + 1] and out.finish_reason == "stop"
    out = run(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3))
    assert len(out.logprobs) == len(out.token_ids) and all(len(lp.top) == 3 for lp in out.logprobs)
    assert all(lp.token_id == lp.top[0][0] for lp in out.logprobs)  # greedy picks the most likely
    out = run(
        SamplingParams(temperature=1.0, max_tokens=6, min_tokens=6, stop_token_ids=list(range(3, 67)), seed=3)
    )  # 64 stop ids: the most a request may give (MAX_STOP_TOKEN_IDS)
    assert len(out.token_ids) == 6 and not set(out.token_ids[:5]) & set(range(3, 67))


def test_stop_string_truncates_text(tiny_config, tiny_params):
    engine = make_engine(tiny_config, tiny_params)
    engine.add_request("t", "hello", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    full = None
    while engine.has_unfinished():
        full = next((o for o in engine.step() if o.finished), full)
    text = full.outputs[0].text
    if len(text) < 4:
        pytest.skip("the random model produced too little text to pick a stop string")
    stop = text[2:4]
    engine.add_request("u", "hello", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))
    streamed, final = "", None
    while engine.has_unfinished():
        for o in engine.step():
            streamed += o.outputs[0].new_text
            final = o if o.finished else final
    assert final.outputs[0].finish_reason == "stop_string"
    assert final.outputs[0].text == text[: text.find(stop)] == streamed


def test_requests_that_cannot_fit_are_rejected(tiny_config, tiny_params):
    engine = make_engine(tiny_config, tiny_params, num_pages=8, max_model_len=512)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("a", [5] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="KV pages"):
        engine.add_request("b", [5] * 200, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request("c", [5, 9999], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("d", [5], SamplingParams(temperature=-1.0))
    assert not engine.has_unfinished()


def test_abort_frees_every_page(tiny_config, tiny_params):
    engine = make_engine(tiny_config, tiny_params)
    for i, prompt in enumerate(make_prompts(4, seed=9)):
        engine.add_request(f"a{i}", prompt, SamplingParams(n=2, temperature=1.0, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv.stats().pages_in_use > 0
    for i in range(4):
        out = engine.abort(f"a{i}")
        assert out.finished and all(c.finish_reason == "abort" for c in out.outputs)
    assert engine.abort("a0") is None
    assert not engine.has_unfinished()
    assert_all_free(engine)


def test_no_recompilation_after_warmup(tiny_config, tiny_params):
    engine = make_engine(tiny_config, tiny_params, num_pages=20, warmup=True, max_num_batched_tokens=64)
    forward = engine.runner._forward  # the step the engine runs (scanned or not)
    compiled = (forward._cache_size(), sample._cache_size(), engine.runner.compile_stats.count)
    xla_compiles = persistent_cache_summary()["requests"]  # every XLA compile of the process, not only ours
    assert engine.runner.warm
    rng = np.random.default_rng(10)
    prompts = make_prompts(24, seed=10, max_len=120)
    params = [
        SamplingParams(
            temperature=float(rng.choice([0.0, 0.8])),
            top_p=float(rng.choice([1.0, 0.9])),
            max_tokens=int(rng.integers(1, 30)),
            n=int(rng.choice([1, 1, 2])),
            ignore_eos=True,
            logprobs=int(rng.choice([0, 2])) or None,
        )
        for _ in prompts
    ]
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        for _ in range(int(rng.integers(0, 3))):
            if pending:
                i, prompt = pending.pop(0)
                engine.add_request(f"w{i}", prompt, params[i])
        engine.step()
    assert engine.stats().num_preemptions > 0  # the workload exercised preemption too
    assert (forward._cache_size(), sample._cache_size(), engine.runner.compile_stats.count) == compiled
    assert engine.stats().compiles_after_warmup == 0
    assert persistent_cache_summary()["requests"] == xla_compiles
    assert_all_free(engine)


def test_a_failing_request_fails_alone(tiny_config, tiny_params, reference):
    engine = make_engine(tiny_config, tiny_params)
    prompts = make_prompts(2, seed=12, max_len=30)
    engine.add_request("ok", prompts[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    engine.add_request("bad", prompts[1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=["x"]))

    class BrokenTokenizer(ByteTokenizer):
        def decode(self, ids, **options):
            raise RuntimeError("detokenizer exploded")

    engine.outputs.requests["bad"].detoks[0].tokenizer = BrokenTokenizer()
    finals = {}
    while engine.has_unfinished():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    assert finals["bad"].error == "RuntimeError: detokenizer exploded"
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert finals["ok"].outputs[0].token_ids == reference(prompts[0])
    assert_all_free(engine)


def test_lookahead_matches_one_step_at_a_time(tiny_config, tiny_params):
    """Async scheduling (step n+1 dispatched before step n's tokens reach the host) changes no output."""
    prompts = make_prompts(8, seed=13, max_len=60)
    rng = np.random.default_rng(13)
    params = [
        SamplingParams(
            temperature=float(rng.choice([0.0, 0.9])),
            top_k=int(rng.choice([0, 20])),
            seed=i,
            max_tokens=int(rng.integers(1, 20)),
            n=int(rng.choice([1, 2])),
            stop_token_ids=[int(rng.integers(3, 259))],
            logprobs=1,
            repetition_penalty=float(rng.choice([1.0, 1.0, 1.3])),
        )
        for i in range(8)
    ]

    def run(async_scheduling: bool):
        engine = make_engine(tiny_config, tiny_params, num_pages=10, async_scheduling=async_scheduling)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"q{i}", prompt, p)
        done = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = [
                        (c.token_ids, c.finish_reason, [lp.logprob for lp in c.logprobs]) for c in o.outputs
                    ]
            check_manager_invariants(engine.kv)
        assert_all_free(engine)
        return done, engine.stats().num_preemptions

    (sync, _), (ahead, preemptions) = run(False), run(True)
    assert sync.keys() == ahead.keys()
    for rid in sync:
        for (t1, f1, l1), (t2, f2, l2) in zip(sync[rid], ahead[rid], strict=True):
            assert t1 == t2 and f1 == f2, rid
            np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-6)
    assert preemptions > 0


def test_lookahead_caches_generated_blocks(tiny_config, tiny_params):
    engine = make_engine(tiny_config, tiny_params)
    prompt = make_prompts(1, seed=14, max_len=20)[0]
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    out = None
    while engine.has_unfinished():
        out = next((o for o in engine.step() if o.finished), out)
    follow_up = prompt + out.outputs[0].token_ids + [7, 8, 9]
    assert engine.kv.lookup_prefix(follow_up) == (len(prompt) + 40 - 1) // 16 * 16
    assert_all_free(engine)


def test_forked_children_never_exceed_max_num_seqs(tiny_config, tiny_params):
    """Issue 14.1: short requests admitted while an n=8 leader is still in chunked prefill used to leave no
    room for its 7 children, and the runner raised `15 exceeds the largest bucket 8`."""
    engine = make_engine(tiny_config, tiny_params, num_pages=200, chunk_size=16)
    engine.add_request(
        "big", list(range(3, 193)), SamplingParams(n=8, temperature=0.8, seed=0, max_tokens=20, ignore_eos=True)
    )
    engine.step()
    for i in range(7):
        engine.add_request(f"small{i}", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    finished = set()
    while engine.has_unfinished():
        finished |= {out.request_id for out in engine.step() if out.finished}
        assert engine.num_running <= 8
    assert finished == {"big", *(f"small{i}" for i in range(7))}
    assert_all_free(engine)


def test_n_above_max_num_seqs_is_rejected(tiny_config, tiny_params):
    """Issue 14.2: a request's samples all run in one batch once its prompt completes, so n > max_num_seqs could
    never be scheduled; it used to wait for ever in front of every later request."""
    engine = make_engine(tiny_config, tiny_params, max_num_seqs=8)
    assert engine.max_n == 8
    with pytest.raises(ValueError, match=r"^n: must be in \[1, 8\]"):
        engine.add_request("nine", [5, 6, 7], SamplingParams(n=9))
    assert not engine.has_unfinished()


def test_outputs_carry_deltas_and_the_whole_output_once(tiny_config, tiny_params):
    """Issue 14.4: every step used to rebuild each sample's whole logprobs list and copy its token ids, so the
    host cost per step grew with the output (n=16, 4,000 tokens, logprobs=20: 45 ms a step). Intermediate
    outputs now carry only what the step added; the final one carries everything, equal to the deltas."""
    engine = make_engine(tiny_config, tiny_params)
    engine.add_request(
        "r", [5, 6, 7, 8], SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=10, logprobs=2, ignore_eos=True)
    )
    deltas: dict[int, list] = {0: [], 1: []}
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            for c in out.outputs:
                assert len(c.new_logprobs) == len(c.new_token_ids)
                deltas[c.index] += [(lp.token_id, lp.logprob) for lp in c.new_logprobs]
                if not out.finished:
                    assert c.token_ids == [] and c.logprobs is None and c.text == ""
            if out.finished:
                final = out
    for c in final.outputs:
        assert len(c.token_ids) == 10
        assert [(lp.token_id, lp.logprob) for lp in c.logprobs] == deltas[c.index]
        assert [t for t, _ in deltas[c.index]] == c.token_ids
    assert_all_free(engine)


def test_request_chosen_sampling_options_compile_nothing_after_warmup(tiny_config, tiny_params):
    """Issue 14.10: the ban list under min_tokens and the penalties' history had request-chosen widths, compiled
    on the engine thread when first seen (17 stop ids with min_tokens: 1.1 s). They have fixed widths now,
    compiled at warm-up, and a request with penalties keeps the lookahead on for the whole batch."""
    from paged_jax.worker.pending import merge_pending_history

    engine = make_engine(tiny_config, tiny_params, num_pages=40, warmup=True)
    compiled = (sample._cache_size(), merge_pending_history._cache_size())
    many_stops = SamplingParams(
        temperature=0.7, seed=1, max_tokens=12, min_tokens=8, stop_token_ids=list(range(100, 117)), logprobs=2
    )
    penalized = SamplingParams(
        temperature=0.0,
        max_tokens=40,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        ignore_eos=True,
    )
    engine.add_request("stops", make_prompts(1, seed=20)[0], many_stops)
    engine.add_request("penalties", make_prompts(1, seed=21, max_len=100)[0], penalized)
    engine.add_request("plain", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    lookahead_steps = 0
    while engine.has_unfinished():
        engine.step()
        lookahead_steps += engine.lookahead.inflight is not None
    assert penalized.uses_penalties and lookahead_steps >= 30  # the penalized request did not turn it off
    assert (sample._cache_size(), merge_pending_history._cache_size()) == compiled
    assert_all_free(engine)
