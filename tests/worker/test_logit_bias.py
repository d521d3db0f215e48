"""Logit bias (`SamplingParams.logit_bias`): added on device before penalties, filters and sampling; logprobs
stay the model's own; validated at the edge."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.config.engine import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.sampling_params import SamplingParams
from paged_jax.tokenization.tokenizer import ByteTokenizer
from paged_jax.worker.logit_bias import apply_logit_bias, fill_logit_bias
from paged_jax.worker.sampler import SamplingMeta, empty_meta, sample

from support.engines import make_engine as _make_engine


def test_apply_logit_bias_adds_at_the_ids_and_nowhere_else():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32)
    ids, values = np.full((3, 4), -1, np.int32), np.zeros((3, 4), np.float32)
    fill_logit_bias(ids[0], values[0], {3: 2.5, 49: -100.0})
    fill_logit_bias(ids[2], values[2], {0: 1.0, 7: 0.5, 8: -0.25, 9: 100.0})
    want = logits.astype(np.float64).copy()
    for r in range(3):
        for t, v in zip(ids[r], values[r], strict=True):
            if t >= 0:
                want[r, t] += v
    got = np.asarray(apply_logit_bias(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(values)))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_array_equal(got[1], logits[1])  # a row without entries is untouched


def biased_meta(rows: int, bias: list[dict[int, float]], temperature: list[float]) -> SamplingMeta:
    m = empty_meta(rows, logit_bias_width=4)
    m["temperature"][:] = temperature
    m["seed"][:, 0] = np.arange(rows)
    for r, b in enumerate(bias):
        fill_logit_bias(m["logit_bias_ids"][r], m["logit_bias"][r], b)
    return SamplingMeta(**{k: jnp.asarray(v) for k, v in m.items()})


def test_empty_bias_columns_leave_every_output_bit_for_bit_as_without_them():
    """Every engine step carries the bias columns (one sampler executable for biased and unbiased steps): rows
    without entries draw the same tokens with the same logprobs as a sampler traced without bias."""
    rng = np.random.default_rng(3)
    rows, vocab = 6, 700
    logits = jnp.asarray((3 * rng.normal(size=(rows, vocab))).astype(np.float32))
    history = rng.integers(0, vocab, size=(rows, 5))
    outs = []
    for width in (0, 300):
        m = empty_meta(rows, history_len=5, logit_bias_width=width)
        m["temperature"][:] = [0.0, 0.7, 1.3, 0.0, 2.0, 0.9]
        m["seed"][:, 0] = np.arange(rows) + 11
        m["step"][:] = 4
        m["repetition_penalty"][:] = 1.3
        m["history"][:] = history
        meta = SamplingMeta(**{k: jnp.asarray(v) for k, v in m.items()})
        flags = dict(do_sample=True, do_filter=False, do_penalty=True, want_logprobs=True)
        outs.append(jax.tree.map(np.asarray, sample(logits, meta, **flags)))
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("do_filter", [False, True])
def test_plus_100_forces_and_minus_100_bans_on_greedy_and_sampled_rows(do_filter):
    rng = np.random.default_rng(1)
    logits = (3 * rng.normal(size=(4, 300))).astype(np.float32)
    top = logits.argmax(-1)
    second = np.argsort(-logits, -1)[:, 1]
    forced = [17, 230, int(top[2]), int(top[3])]
    bias = [{17: 100.0}, {230: 100.0}, {forced[2]: -100.0}, {}]
    meta = biased_meta(4, bias, [0.0, 1.0, 0.0, 0.0])
    if do_filter:
        meta = meta._replace(top_k=jnp.asarray([0, 5, 0, 0], jnp.int32))
    out = sample(jnp.asarray(logits), meta, do_sample=True, do_filter=do_filter, do_penalty=False, want_logprobs=True)
    tokens = np.asarray(out.tokens)
    assert tokens[0] == 17 and tokens[1] == 230  # greedy and sampled rows alike
    assert tokens[2] == second[2]  # the ban moved the greedy pick to the runner-up
    assert tokens[3] == top[3]  # no bias: unchanged
    x = logits.astype(np.float64)
    raw = x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out.logprob), raw[np.arange(4), tokens], atol=1e-5)  # unbiased
    np.testing.assert_array_equal(np.asarray(out.top_ids)[:, 0], top)


make_engine = partial(_make_engine, num_pages=64)


def generate(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert engine.kv.stats().pages_in_use == 0
    return [done[f"r{i}"] for i in range(len(requests))]


def test_engine_forces_bans_and_leaves_other_requests_alone(tiny_config, tiny_params):
    engine = make_engine(tiny_config, tiny_params)
    prompt = list(range(10, 40))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (plain,) = generate(engine, [(prompt, greedy)])
    banned = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={plain[0]: -100.0})
    forced_greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={123: 100.0})
    forced_hot = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logit_bias={77: 100.0})
    got = generate(engine, [(prompt, banned), (prompt, forced_greedy), (prompt, forced_hot), (prompt, greedy)])
    assert got[0][0] != plain[0] and plain[0] not in got[0]
    assert got[1] == [123] * 6 and got[2] == [77] * 6
    assert got[3] == plain


@pytest.mark.parametrize(
    "bias, message",
    [
        ({"5": 1.0}, "is not a token id"),
        ({True: 1.0}, "is not a token id"),
        ({-1: 1.0}, "is not a token id"),
        ({320: 1.0}, "is not a token id"),
        ({5: 100.5}, r"must be a number in \[-100, 100\]"),
        ({5: float("nan")}, r"must be a number in \[-100, 100\]"),
        ({5: "1"}, r"must be a number in \[-100, 100\]"),
        ({1: 1.0, 2: 1.0, 3: 1.0}, "3 entries, more than 2"),
        ([5, 1.0], "must be a map"),
    ],
)
def test_invalid_logit_bias_names_the_field(tiny_config, tiny_params, bias, message):
    engine = LLMEngine(
        tiny_config, tiny_params, ByteTokenizer(), EngineConfig(num_pages=16, warmup=False, max_logit_bias=2)
    )
    with pytest.raises(ValueError, match=f"^logit_bias: .*{message}"):
        engine.add_request("x", [5, 6], SamplingParams(logit_bias=bias))
    assert not engine.has_unfinished()
