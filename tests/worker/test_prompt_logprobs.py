"""Prompt logprobs (`SamplingParams.prompt_logprobs`) and prompt-only requests (`max_tokens=0`).

Against transformers: the HF parity models' golden logits (tests/data/hf_*, every prompt position, made by
scripts/golden/make_hf_golden.py) give log_softmax of the shifted logits, which the engine's prompt logprobs must equal
within 1e-4 in float32, across chunk boundaries. Against the dense model (`paged_jax.model.reference`): chunking
into several LM-head blocks, a cached prefix, n > 1, preemption, the lookahead, quantized KV. Every test ends with
every page free.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.load import load_model
from paged_jax.model.families import causal_lm
from paged_jax.model.reference import full_logits
from paged_jax.outputs import RequestOutput
from paged_jax.sampling_params import MAX_LOGPROBS, SamplingParams

from support.engines import make_engine

DATA = Path(__file__).parents[1] / "data"
HF_VARIANTS = ("gqa", "mqa", "tied", "llama3_rope", "head_dim128", "qwen2", "sharded")
ATOL = 1e-4


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    """All requests at once; returns each request's outputs in order. Checks every page came back."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    engine.check_invariants()
    assert engine.kv.stats().pages_in_use == 0
    return outs


def check_prompt_logprobs(out: RequestOutput, prompt: list[int], want: np.ndarray, k: int, atol: float = ATOL):
    """`out.prompt_logprobs` against want = log_softmax of the logits at each prompt position [len(prompt), V]."""
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry, row = got[i], want[i - 1]
        assert entry.token_id == prompt[i]
        assert abs(entry.logprob - row[prompt[i]]) < atol, (i, entry.logprob, row[prompt[i]])
        assert len(entry.top) == k
        ids = [t for t, _ in entry.top]
        np.testing.assert_allclose([v for _, v in entry.top], row[ids], atol=atol)
        np.testing.assert_allclose([v for _, v in entry.top], np.sort(row)[::-1][:k], atol=atol)


@pytest.mark.parametrize("variant", HF_VARIANTS)
def test_prompt_logprobs_equal_transformers(variant):
    """Three prompts (5, 11, 23 tokens) in one engine, chunks of 8 tokens: every position within 1e-4 of HF."""
    config, params, _ = load_model(DATA / f"hf_{variant}", dtype="float32")
    golden = np.load(DATA / f"hf_{variant}" / "golden.npz")
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(3)]
    engine = make_engine(config, params, max_num_batched_tokens=16, chunk_size=8, page_size=8, num_pages=40)
    params_ = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=5)
    outs = run(engine, [(p, params_) for p in prompts])
    for i, prompt in enumerate(prompts):
        final = outs[f"r{i}"][-1]
        assert final.finished and final.outputs[0].token_ids == [] and final.outputs[0].finish_reason == "length"
        check_prompt_logprobs(final, prompt, log_softmax(golden[f"logits_{i}"]), 5)


@pytest.fixture(scope="module")
def dense(tiny_config, tiny_params):
    """log_softmax of the dense model's logits at every position of a prompt: [len, V] float64."""
    model = causal_lm(tiny_config)

    def get(prompt: list[int]) -> np.ndarray:
        n = 1 << max(4, (len(prompt) - 1).bit_length())
        buf = jnp.zeros(n, jnp.int32).at[: len(prompt)].set(jnp.asarray(prompt, jnp.int32))
        return log_softmax(np.asarray(full_logits(model, tiny_params, buf, jnp.int32(len(prompt))))[: len(prompt)])

    return get


def prompts(n: int, seed: int, lo: int, hi: int, prefix: list[int] | None = None) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [(prefix or []) + rng.integers(3, 259, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["lookahead", "sync"])
def test_chunks_blocks_and_a_mixed_batch(tiny_config, tiny_params, dense, async_scheduling):
    """Long prompts in chunks of 50 (steps of up to 128 tokens: two LM-head blocks), next to requests that do
    not ask and one that asks for 0 alternatives; generation afterwards is unchanged."""
    engine = make_engine(
        tiny_config, tiny_params, max_num_batched_tokens=128, chunk_size=50, async_scheduling=async_scheduling
    )
    ps = prompts(4, seed=1, lo=60, hi=200)
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=MAX_LOGPROBS),
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=2, logprobs=1),
    ]
    outs = run(engine, list(zip(ps, kinds, strict=True)))
    for i, (prompt, params) in enumerate(zip(ps, kinds, strict=True)):
        final = outs[f"r{i}"][-1]
        if params.prompt_logprobs is None:
            assert all(o.prompt_logprobs is None for o in outs[f"r{i}"])
            continue
        check_prompt_logprobs(final, prompt, dense(prompt), params.prompt_logprobs)
        # once on the first output that has them (with the first token), again only on the final one
        carrying = [j for j, o in enumerate(outs[f"r{i}"]) if o.prompt_logprobs is not None]
        assert carrying[0] == 0 and carrying[-1] == len(outs[f"r{i}"]) - 1 and len(carrying) <= 2
    tokens = {i: outs[f"r{i}"][-1].outputs[0].token_ids for i in range(4)}
    assert tokens[2] == [] and all(len(tokens[i]) == 5 for i in (0, 1, 3))
    assert tokens[0] == [int(np.argmax(dense(ps[0] + tokens[0])[len(ps[0]) - 1 + j])) for j in range(5)]


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(tiny_config, tiny_params, dense):
    """A request asking prompt logprobs does not read the prefix cache (cached tokens have no logits) but still
    fills it: the next plain request hits what it wrote."""
    engine = make_engine(tiny_config, tiny_params)
    prefix = prompts(1, seed=2, lo=64, hi=65)[0]
    first, second, third = prompts(3, seed=3, lo=5, hi=20, prefix=prefix)
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    run(engine, [(first, greedy)])
    hits = engine.stats().prefix_hits
    out = run(engine, [(second, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1))])["r0"][-1]
    assert out.metrics.num_cached_prompt_tokens == 0 and engine.stats().prefix_hits == hits
    check_prompt_logprobs(out, second, dense(second), 1)
    out = run(engine, [(third, greedy)])["r0"][-1]
    assert out.metrics.num_cached_prompt_tokens == 64


def test_n_samples_share_one_set_of_prompt_logprobs(tiny_config, tiny_params, dense):
    engine = make_engine(tiny_config, tiny_params)
    prompt = prompts(1, seed=4, lo=40, hi=41)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, prompt_logprobs=4)
    final = run(engine, [(prompt, params)])["r0"][-1]
    assert [len(c.token_ids) for c in final.outputs] == [6, 6, 6]
    check_prompt_logprobs(final, prompt, dense(prompt), 4)
    scored = run(engine, [(prompt, SamplingParams(n=2, max_tokens=0, prompt_logprobs=4))])["r0"][-1]
    assert [c.token_ids for c in scored.outputs] == [[], []]
    check_prompt_logprobs(scored, prompt, dense(prompt), 4)


def test_preempted_requests_give_every_prompt_logprob_once(tiny_config, tiny_params, dense):
    """A tiny cache: requests are preempted mid-prompt and after it and recomputed; the logprobs are exact."""
    engine = make_engine(tiny_config, tiny_params, num_pages=14, chunk_size=32)
    ps = prompts(6, seed=5, lo=50, hi=90)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=3)
    outs = run(engine, [(p, params) for p in ps])
    assert engine.stats().num_preemptions > 0
    for i, prompt in enumerate(ps):
        check_prompt_logprobs(outs[f"r{i}"][-1], prompt, dense(prompt), 3)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv(tiny_config, tiny_params, dense, kv_dtype):
    """Quantized pages change the math slightly: the logprobs stay close to the float model's, and equal the
    logprobs the same engine gives the tokens it generates (the same positions, decoded instead of prefilled)."""
    engine = make_engine(tiny_config, tiny_params, kv_dtype=kv_dtype, chunk_size=16)
    prompt = prompts(1, seed=6, lo=40, hi=41)[0]
    gen = run(engine, [(prompt, SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True))])
    completion = gen["r0"][-1].outputs[0]
    full = prompt + completion.token_ids
    out = run(engine, [(full, SamplingParams(max_tokens=0, prompt_logprobs=2))])["r0"][-1]
    check_prompt_logprobs(out, full, dense(full), 2, atol=0.05)
    decoded = [lp.logprob for lp in completion.logprobs]
    prefilled = [e.logprob for e in out.prompt_logprobs[len(prompt) :]]
    np.testing.assert_allclose(prefilled, decoded, atol=0.02)


def test_abort_mid_prompt_frees_every_page(tiny_config, tiny_params):
    engine = make_engine(tiny_config, tiny_params, chunk_size=16)
    engine.add_request("a", prompts(1, seed=7, lo=100, hi=101)[0], SamplingParams(max_tokens=0, prompt_logprobs=1))
    engine.step()
    engine.step()
    final = engine.abort("a")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    while engine.has_unfinished() or engine.lookahead.inflight is not None:
        engine.step()
    assert engine.kv.stats().pages_in_use == 0


def test_no_recompilation_in_steady_state(tiny_config, tiny_params):
    """After warm-up, requests with prompt logprobs, logit bias and both mixed with plain ones compile nothing."""
    engine = make_engine(tiny_config, tiny_params, warmup=True, max_num_batched_tokens=32, chunk_size=24)
    compiled = engine.runner.compile_stats.count
    ps = prompts(8, seed=8, lo=2, hi=70)
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2),
        SamplingParams(temperature=0.8, max_tokens=6, logit_bias={5: 3.0, 9: -100.0}),
        SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=0, logit_bias={7: 1.0}),
        SamplingParams(temperature=0.0, max_tokens=5),
    ]
    run(engine, [(p, kinds[i % 4]) for i, p in enumerate(ps)])
    assert engine.runner.compile_stats.count == compiled and engine.stats().compiles_after_warmup == 0


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
        (SamplingParams(prompt_logprobs=MAX_LOGPROBS + 1), "prompt_logprobs"),
        (SamplingParams(prompt_logprobs=True), "prompt_logprobs"),
        (SamplingParams(max_tokens=-1), "max_tokens"),
        (SamplingParams(max_tokens=0, min_tokens=1), "min_tokens"),
    ],
)
def test_invalid_values_name_the_field(tiny_config, tiny_params, params, field):
    engine = make_engine(tiny_config, tiny_params)
    with pytest.raises(ValueError, match=f"^{field}:"):
        engine.add_request("x", [5, 6, 7], params)
    assert not engine.has_unfinished()
