"""On-device sampling: each filter and penalty does what vLLM users expect, and seeds are per row."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.worker.sampler import (
    BLOCK,
    FILTER_CANDIDATES,
    SamplingMeta,
    categorical,
    empty_meta,
    first_argmax,
    row_uniforms,
    sample,
)

V = 64


def meta(rows: int, **fields) -> dict:
    m = empty_meta(rows)
    for k, v in fields.items():
        m[k][...] = v
    return m


def draw(logits, m, *, steps=64, **flags):
    """Token draws for `steps` different output positions (different keys) of every row: [steps, rows]."""
    out = []
    for step in range(steps):
        m["step"][:] = step
        res = sample(
            jnp.asarray(logits),
            SamplingMeta(**{k: jnp.asarray(v) for k, v in m.items()}),
            do_sample=flags.get("do_sample", True),
            do_filter=flags.get("do_filter", False),
            do_penalty=flags.get("do_penalty", False),
            want_logprobs=flags.get("want_logprobs", False),
        )
        out.append(np.asarray(res.tokens))
    return np.stack(out)


@pytest.fixture(scope="module")
def logits():
    return np.asarray(jax.random.normal(jax.random.key(0), (4, V)) * 3, np.float32)


def test_greedy_is_argmax(logits):
    got = draw(logits, meta(4), steps=1, do_sample=False)
    assert (got[0] == logits.argmax(-1)).all()


def test_top_k_only_draws_the_k_best(logits):
    m = meta(4, temperature=5.0, top_k=3)
    got = draw(logits, m, do_filter=True)
    best = np.argsort(-logits, axis=-1)[:, :3]
    for r in range(4):
        assert set(got[:, r]) <= set(best[r]) and len(set(got[:, r])) > 1


def test_top_p_keeps_the_smallest_nucleus(logits):
    m = meta(4, temperature=1.0, top_p=0.5)
    got = draw(logits, m, do_filter=True)
    probs = jax.nn.softmax(jnp.asarray(logits), -1)
    for r in range(4):
        order = np.argsort(-np.asarray(probs[r]))
        cum = np.cumsum(np.asarray(probs[r])[order])
        nucleus = set(order[: int(np.searchsorted(cum, 0.5)) + 1])
        assert set(got[:, r]) <= nucleus


def test_min_p_drops_unlikely_tokens(logits):
    m = meta(4, temperature=3.0, min_p=0.2)
    got = draw(logits, m, do_filter=True)
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits) / 3.0, -1))
    for r in range(4):
        assert all(probs[r, t] >= 0.2 * probs[r].max() for t in got[:, r])


def test_seeds_are_per_row_and_reproducible(logits):
    m = meta(4, temperature=1.0)
    m["seed"][:, 0] = [7, 7, 8, 9]
    rows = np.repeat(logits[:1], 4, axis=0)
    got = draw(rows, m)
    assert (got[:, 0] == got[:, 1]).all()  # same seed, same logits: same draws
    assert not (got[:, 0] == got[:, 2]).all()
    again = draw(rows, m)
    assert (got == again).all()


def test_suppressed_ids_are_never_drawn(logits):
    m = meta(4)
    m["suppress"][:, 0] = logits.argmax(-1)
    got = draw(logits, m, steps=1, do_sample=False)
    assert (got[0] == np.argsort(-logits, -1)[:, 1]).all()


def test_penalties_follow_vllm_semantics():
    logits = np.zeros((1, V), np.float32)
    logits[0, :4] = [2.0, -2.0, 1.0, 1.0]
    m = meta(1, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    m["history"] = np.full((1, 8), -1, np.int32)
    m["history"][0, :5] = [0, 1, 2, 2, 2]  # prompt [0, 1], output [2, 2, 2]
    m["num_prompt"][:] = 2
    from paged_jax.worker.sampler import _apply_penalties

    got = np.asarray(_apply_penalties(jnp.asarray(logits), SamplingMeta(**{k: jnp.asarray(v) for k, v in m.items()})))
    # repetition: positive logits divided, negative multiplied (prompt and output); presence and frequency:
    # output tokens only.
    assert got[0, 0] == pytest.approx(1.0)
    assert got[0, 1] == pytest.approx(-4.0)
    assert got[0, 2] == pytest.approx(0.5 - 0.5 - 0.75)
    assert got[0, 3] == pytest.approx(1.0)


def test_logprobs_are_of_the_raw_distribution(logits):
    m = meta(4, temperature=0.0)
    res = sample(
        jnp.asarray(logits),
        SamplingMeta(**{k: jnp.asarray(v) for k, v in m.items()}),
        do_sample=False,
        do_filter=False,
        do_penalty=False,
        want_logprobs=True,
    )
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))
    np.testing.assert_allclose(np.asarray(res.logprob), ref.max(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(res.top_logprobs)[:, 0], ref.max(-1), rtol=1e-5, atol=1e-6)
    assert (np.asarray(res.top_ids)[:, 0] == logits.argmax(-1)).all()


def test_suppressed_ids_stay_banned_at_any_temperature(logits):
    """Issue 14.9: the ban (EOS under min_tokens) was a finite mask applied before dividing by the temperature;
    at temperature 1e30 it became about -1e0 and EOS was drawn inside min_tokens."""
    m = meta(4, temperature=3e38)  # finite in float32: allowed
    banned = logits.argmax(-1)
    m["suppress"][:, 0] = banned
    got = draw(logits, m, steps=256)
    assert not (got == banned[None, :]).any()
    assert len(np.unique(got)) > 10  # and the temperature does flatten the rest


def test_tiny_temperatures_are_greedy(logits):
    """A temperature so small that x / t overflows float32 (every positive logit inf) samples greedily."""
    m = meta(4, temperature=1e-40)
    assert (draw(logits, m, steps=4) == logits.argmax(-1)[None, :]).all()


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_values_are_validated_in_float32(field):
    """Issue 14.9: 1e300 is finite in float64 but inf in float32, the dtype the device samples in."""
    from paged_jax.sampling_params import SamplingParams

    with pytest.raises(ValueError, match=f"^{field}: .*float32"):
        SamplingParams(**{field: 1e300}).validate()


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 3e38},
        {"temperature": 100.5},
        {"repetition_penalty": 1e-38},
        {"repetition_penalty": 0.009},
        {"repetition_penalty": 101.0},
    ],
)
def test_extreme_values_are_refused(fields):
    """Issue 25.11: repetition_penalty=1e-38 made every token id 0; temperature=3e38 defeated top_k=1 and min_p=1."""
    from paged_jax.sampling_params import SamplingParams

    with pytest.raises(ValueError, match=f"^{next(iter(fields))}: must be in"):
        SamplingParams(**fields).validate()


def test_the_accepted_extremes_are_exact(logits):
    """At the documented limits the math still does what the fields say (checked against numpy)."""
    best = logits.argmax(-1)
    for filters in ({"top_k": 1}, {"min_p": 1.0}):  # only the best token survives, even at the highest temperature
        assert (draw(logits, meta(4, temperature=100.0, **filters), steps=32, do_filter=True) == best).all()
    flat = np.unique(draw(logits, meta(4, temperature=100.0), steps=256))
    assert len(flat) > V // 2  # and the temperature does flatten the distribution
    for rp in (0.01, 100.0):  # greedy after the penalty: the numpy reference of vLLM's rule
        m = meta(4, repetition_penalty=rp)
        m["history"] = np.tile(np.arange(8, dtype=np.int32), (4, 1))  # tokens 0..7 seen (prompt)
        m["num_prompt"][:] = 8
        seen = np.arange(V) < 8
        ref = np.where(seen, np.where(logits > 0, logits / rp, logits * rp), logits).argmax(-1)
        assert np.isfinite(np.where(logits > 0, logits / rp, logits * rp)).all()
        assert (draw(logits, m, steps=1, do_sample=False, do_penalty=True)[0] == ref).all()


def sort_reference_drop(y: jax.Array, top_k, top_p, min_p) -> np.ndarray:
    """The sort-based filter the sampler used before (vLLM's definition): bool [S, V], True = dropped."""
    vocab = y.shape[1]
    order = jnp.argsort(-y, axis=-1)
    vals = jnp.take_along_axis(y, order, axis=-1)
    probs = jax.nn.softmax(vals, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
    drop |= ((jnp.cumsum(probs, axis=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop &= rank > 0
    out = np.zeros(y.shape, bool)
    np.put_along_axis(out, np.asarray(order), np.asarray(drop), axis=-1)
    return out


@pytest.mark.parametrize("vocab,scale", [(1000, 3.0), (49152, 8.0), (300, 0.01)])
def test_sort_free_filter_equals_the_sort_based_reference(vocab, scale):
    """`filter_mask` (the top-score list, bisection below it where needed) keeps exactly the tokens the
    sort-based filter keeps, on random logits with every combination of top-k, top-p and min-p, off values
    included."""
    from paged_jax.worker.sampler import filter_mask

    rows = 48
    rng = np.random.default_rng(vocab)
    y = jnp.asarray(rng.standard_normal((rows, vocab)) * scale, jnp.float32)
    top_k = jnp.asarray(rng.choice([0, 1, 2, 7, 50, vocab - 1, vocab], rows), jnp.int32)
    top_p = jnp.asarray(rng.choice([1.0, 0.99, 0.9, 0.5, 0.1, 1e-6], rows), jnp.float32)
    min_p = jnp.asarray(rng.choice([0.0, 0.0, 0.01, 0.3], rows), jnp.float32)
    want = ~sort_reference_drop(y, top_k, top_p, min_p)
    probs = jax.nn.softmax(y, axis=-1)
    # The default list, a longer one (every row decided in it alone for V = 300), and nearly every row bisected.
    for cap in (FILTER_CANDIDATES, 300, 2):
        keep = np.asarray(jax.jit(partial(filter_mask, cap=cap))(y, probs, top_k, top_p, min_p))
        np.testing.assert_array_equal(keep, want)
    kept = keep.sum(-1)
    # Not all trivial, and some rows keep more than the list holds (the default cap bisects them).
    assert kept.min() >= 1 and kept.max() > FILTER_CANDIDATES and (kept == 1).any()


def inverse_cdf_reference(weights: np.ndarray, u: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """The draw rule `categorical` implements, in float64 numpy: a block of `block` tokens by u[:, 0] against the
    running block sums, then a token inside it by u[:, 1] against the block's running sums. [S] ids."""
    out = []
    for w, (u0, u1) in zip(weights.astype(np.float64), u.astype(np.float64), strict=True):
        w = np.pad(w, (0, -len(w) % block)).reshape(-1, block)
        cum = np.cumsum(w.sum(-1))
        b = int(np.argmax(cum > u0 * cum[-1]))
        inside = np.cumsum(w[b])
        out.append(b * block + int(np.argmax(inside > u1 * inside[-1])))
    return np.asarray(out)


def test_filtered_draws_follow_the_inverse_cdf_rule_over_the_sort_based_kept_set():
    """Whole draws: the sampler's tokens are the two-stage inverse-CDF draw (`inverse_cdf_reference`, with the
    row's own `row_uniforms`) from softmax(y) restricted to the sort-based reference's kept set, row by row."""
    big = np.asarray(jax.random.normal(jax.random.key(3), (16, 512)) * 2, np.float32)
    m = meta(16, temperature=0.7)
    m["top_k"][:] = [0, 5, 40, 0] * 4
    m["top_p"][:] = [0.8, 1.0, 0.95, 0.3] * 4
    m["min_p"][:] = [0.0, 0.0, 0.02, 0.0] * 4
    m["seed"][:, 0] = np.arange(16)
    got = draw(big, m, steps=8, do_filter=True)
    y = np.asarray(jnp.asarray(big) / 0.7)
    drop = sort_reference_drop(
        jnp.asarray(y), jnp.asarray(m["top_k"]), jnp.asarray(m["top_p"]), jnp.asarray(m["min_p"])
    )
    weights = np.where(drop, 0.0, np.exp(y - y.max(-1, keepdims=True)))
    for step in range(8):
        m["step"][:] = step
        u = np.asarray(row_uniforms(SamplingMeta(**{k: jnp.asarray(v) for k, v in m.items()})))
        np.testing.assert_array_equal(got[step], inverse_cdf_reference(weights, u))
    assert len(np.unique(got)) > 16  # not all trivial


@pytest.mark.parametrize("vocab", [64, 300, 1000])
def test_categorical_is_the_two_stage_inverse_cdf(vocab):
    """`categorical` on random weights (zeros included) and uniforms picks exactly the reference's token, and a
    token of weight 0 never; uniforms at the edges (0 and just below 1) included."""
    rng = np.random.default_rng(vocab)
    rows = 256
    weights = np.exp(rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    weights[rng.random((rows, vocab)) < 0.3] = 0.0
    weights[0, 1:], weights[0, 0] = 0.0, 1.0  # one token left
    u = rng.random((rows, 2)).astype(np.float32)
    u[1], u[2] = 0.0, np.float32(1 - 2**-24)
    got = np.asarray(jax.jit(categorical)(jnp.asarray(weights), jnp.asarray(u)))
    np.testing.assert_array_equal(got, inverse_cdf_reference(weights, u))
    assert (weights[np.arange(rows), got] > 0).all() and got[0] == 0


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's goodness of fit of `counts` to `probs`, categories with expected count < 5 pooled."""
    from scipy.stats import chi2  # a dependency of jax

    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(chi2.sf(stat, len(obs) - 1))


def test_draws_follow_the_softmax_distribution():
    """8,192 seeded draws (512 rows with their own seeds, 16 output positions) from one row of logits over 300
    tokens (three blocks, the last one partly padding) fit softmax(logits / T) by a chi-square test, and do
    not fit the distribution of a slightly different temperature (the test can fail). Banned ids are never
    drawn. Deterministic: fixed seeds."""
    vocab, rows, temp = 300, 512, 0.9
    row = np.asarray(jax.random.normal(jax.random.key(5), (vocab,)), np.float32)
    m = meta(rows, temperature=temp)
    m["seed"][:, 0] = np.arange(rows)
    m["suppress"][:, :2] = [7, 299]
    got = draw(np.repeat(row[None], rows, 0), m, steps=16).ravel()
    counts = np.bincount(got, minlength=vocab)
    assert counts[7] == counts[299] == 0
    allowed = np.ones(vocab, bool)
    allowed[[7, 299]] = False

    def dist(t: float) -> np.ndarray:
        p = np.where(allowed, np.exp((row - row.max()) / t), 0.0)
        return p / p.sum()

    assert chi_square_p_value(counts[allowed], dist(temp)[allowed]) > 1e-3
    assert chi_square_p_value(counts[allowed], dist(temp * 1.25)[allowed]) < 1e-6


def test_a_seeded_row_draws_the_same_tokens_in_any_batch(logits):
    """A row's draws depend on its own seed, step and logits only: alone (a 1-row batch) or as row 5 of 16
    beside other rows and seeds (another compiled shape), with and without filters."""
    target = np.asarray(jax.random.normal(jax.random.key(9), (1, V)) * 2, np.float32)
    for flags in ({"do_filter": False}, {"do_filter": True}):
        alone = meta(1, temperature=0.8, top_p=0.95, top_k=20)
        alone["seed"][:] = [1234, 5]
        mixed = meta(16, temperature=1.3, top_p=0.5, top_k=3)
        mixed["seed"][:, 0] = np.arange(16)
        for f in ("temperature", "top_p", "top_k", "seed"):
            mixed[f][5] = alone[f][0]
        others = np.array(jax.random.normal(jax.random.key(10), (16, V)) * 4, np.float32)
        others[5] = target[0]
        a = draw(target, alone, steps=32, **flags)[:, 0]
        b = draw(others, mixed, steps=32, **flags)[:, 5]
        np.testing.assert_array_equal(a, b)
        assert len(np.unique(a)) > 3


@pytest.mark.parametrize("vocab", [64, 1000, 50257])
def test_first_argmax_equals_argmax(vocab):
    """`first_argmax` is `jnp.argmax` exactly: ties (coarsely rounded scores) go to the first index, a NaN wins
    (the first one), an all -inf row gives 0, a vocabulary that is not a multiple of the block is padded."""
    rng = np.random.default_rng(vocab)
    x = np.round(rng.standard_normal((32, vocab)) * 2).astype(np.float32)  # many ties at the max
    x[1, :] = -np.inf
    x[2, [vocab // 3, vocab - 1]] = np.nan
    x[3, -1] = 100.0
    x[4, :] = np.float32(-3e38)
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got[2] == vocab // 3 and got[3] == vocab - 1


@pytest.mark.parametrize("scale", [0.01, 3.0, 30.0])
def test_greedy_logprob_equals_log_softmax(scale):
    """The chosen token's logprob (its logit minus the row's logsumexp, no [S, V] log-softmax) equals
    `jax.nn.log_softmax` at the token to float32 rounding, on random logits; with logprobs wanted the top
    list still comes from the full rows."""
    logits = jnp.asarray(np.random.default_rng(int(scale * 100)).standard_normal((32, 50257)) * scale, jnp.float32)
    m = SamplingMeta(**{k: jnp.asarray(v) for k, v in meta(32).items()})
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for want in (False, True):
        res = sample(logits, m, do_sample=False, do_filter=False, do_penalty=False, want_logprobs=want)
        tokens = np.asarray(res.tokens)
        np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), -1))
        np.testing.assert_allclose(np.asarray(res.logprob), ref[np.arange(32), tokens], rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(res.top_ids)[:, 0], tokens)
