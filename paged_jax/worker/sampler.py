"""On-device sampling: penalties, temperature, top-k / top-p / min-p, per-request seeds, logprobs.

One row per sequence that samples this step. Everything runs inside one jitted function so only the sampled
ids (and requested logprobs) come back to the host, and nothing sorts the vocabulary, on every platform:
top-k / top-p / min-p (`filter_mask`) find each row's threshold among its 64 highest scores (`lax.top_k`),
bisecting over float32 values only for a row whose threshold lies below them.

Randomness is inverse-CDF sampling with two uniforms per row (`categorical`) from a key derived from the
request's own seed and its output position, so a seeded request draws the same tokens whatever else is in the
batch. It replaced Gumbel-max, which drew V uniforms per row (threefry: most of the old sampling step's time
on CPU; JAX's `rbg` keys were slower still on XLA:CPU); the distribution is the same, the draws for a given
seed are not. Greedy rows never build a [S, V] log-softmax (the chosen token's logprob is its logit minus
the row's logsumexp) and take the argmax blockwise (`first_argmax`). `scripts/bench/bench_sampler.py` measures it
against the old sampler.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.sampling_params import MAX_LOGPROBS
from paged_jax.structured.bitmask import apply_bitmask
from paged_jax.worker.logit_bias import apply_logit_bias
from pallas_kernels.common import MASK_VALUE as MASK

MIN_TEMPERATURE = 1e-5  # below it sampling is greedy (as in vLLM): x / t would overflow float32
BLOCK = 128  # consecutive tokens per block in the two-stage scans (`first_argmax`, `categorical`)


class SamplingMeta(NamedTuple):
    """Per-row sampling inputs, padded to the row bucket `S` (padding rows are greedy and ignored)."""

    temperature: jax.Array  # [S] f32; 0 = greedy
    top_k: jax.Array  # [S] i32; 0 = off
    top_p: jax.Array  # [S] f32; 1 = off
    min_p: jax.Array  # [S] f32; 0 = off
    repetition_penalty: jax.Array  # [S] f32; 1 = off
    presence_penalty: jax.Array  # [S] f32
    frequency_penalty: jax.Array  # [S] f32
    seed: jax.Array  # [S, 2] u32 (low, high words of the request seed)
    step: jax.Array  # [S] i32: index of the token being drawn within the request's output
    suppress: jax.Array  # [S, K] i32 token ids to forbid this step (EOS under min_tokens); -1 = none
    history: jax.Array  # [S, L] i32 prompt then output ids for penalties; -1 = padding ([S, 1] when unused)
    num_prompt: jax.Array  # [S] i32: how many leading history entries are prompt tokens
    logit_bias_ids: jax.Array  # [S, W] i32 token ids to bias (-1 = none); W = 0 when no row has a bias
    logit_bias: jax.Array  # [S, W] f32 the bias added to each (`paged_jax.worker.logit_bias`)


class SamplerOutput(NamedTuple):
    tokens: jax.Array  # [S] i32
    logprob: jax.Array  # [S] f32: log-probability of the chosen token under the raw model distribution
    top_ids: jax.Array  # [S, K] i32 (K = MAX_LOGPROBS when logprobs are wanted, else 0)
    top_logprobs: jax.Array  # [S, K] f32


def _apply_penalties(logits: jax.Array, meta: SamplingMeta) -> jax.Array:
    """vLLM semantics: repetition over prompt and output; presence and frequency over output only."""
    num_rows, vocab = logits.shape
    hist = meta.history
    valid = hist >= 0
    ids = jnp.where(valid, hist, vocab)  # out of range -> dropped by the scatter
    is_output = valid & (jnp.arange(hist.shape[1])[None, :] >= meta.num_prompt[:, None])
    rows = jnp.arange(num_rows)[:, None]
    out_counts = jnp.zeros((num_rows, vocab), jnp.float32).at[rows, ids].add(is_output.astype(jnp.float32), mode="drop")
    seen = jnp.zeros((num_rows, vocab), jnp.bool_).at[rows, ids].set(valid, mode="drop")
    rp = meta.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - meta.frequency_penalty[:, None] * out_counts
    return logits - meta.presence_penalty[:, None] * (out_counts > 0)


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (negative floats have their bits flipped, positives the sign)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


FILTER_CANDIDATES = 64  # the top scores `filter_mask` looks at first (lax.top_k: 1.9 ms at 32 x 32,000, 2 cores)


def filter_mask(
    y: jax.Array, probs: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array, cap: int = FILTER_CANDIDATES
) -> jax.Array:
    """Which tokens top-k, top-p and min-p keep, without sorting: bool [S, V] for scaled logits y [S, V] f32 and
    probs = softmax(y) [S, V] (the sampler has it already).

    Semantics (vLLM's, over the distribution p = softmax(y)): a token is dropped when `top_k` > 0 and at least
    `top_k` tokens score higher, when the probability mass of the tokens scoring higher is >= `top_p`
    (`top_p` >= 1: off), or when p < `min_p` x max(p); the most likely token always survives. The first two
    are "at least so much above me", so each keeps every token scoring at least some threshold t: the
    smallest score with fewer than k tokens (and less than top_p mass) above it, exactly the score of the last
    kept token. Ties at the threshold are all kept (a sort would keep some of them); -0.0 counts as 0.0.

    t is the larger of top-k's threshold and top-p's, each found without sorting the vocabulary. First among
    the row's `cap` highest scores (`lax.top_k`): every token scoring above the lowest of them is in that list,
    so the count and the mass above each listed score are exact, and when the lowest listed score fails a
    part, that part's threshold is the lowest listed score that passes (top-k below `cap`, or a nucleus inside
    the top `cap`: the common case). Otherwise it is at most the lowest listed score and that row bisects it
    over the float32 values in order below that (at most 32 masked counts or masked sums over its
    vocabulary, not both: the row's scores and probabilities stay in the core's cache). Measured at 32 rows x
    32,000 on 2 cores: with top-k 50 and top-p 0.9, 21 ms bisecting both parts of every row (the old way)
    against about 3 ms (1.9 ms of it `lax.top_k`; a top-k over the 64 best blocks of 128 saved little); with
    top-p 0.95 alone and nuclei of hundreds of tokens, 19 ms bisecting both parts, 10 ms bisecting the mass.
    """
    rows, vocab = y.shape
    keys = _order_keys(jnp.where(y == 0, 0.0, y))  # [S, V]
    cap = min(cap, vocab)
    _, idx = jax.lax.top_k(y, cap)  # [S, cap], scores descending
    list_keys = jnp.take_along_axis(keys, idx, axis=-1)
    list_probs = jnp.take_along_axis(probs, idx, axis=-1)
    above = list_keys[:, None, :] > list_keys[:, :, None]  # [S, cap, cap]: [r, i, j] = listed j above listed i
    count = jnp.sum(above, axis=-1)
    mass = jnp.sum(jnp.where(above, list_probs[:, None, :], 0.0), axis=-1)
    # The threshold is the larger of top-k's and top-p's (each alone keeps everything at or above its own).
    ok_k = (top_k[:, None] <= 0) | (count < top_k[:, None])  # [S, cap]: would top-k keep the listed score?
    ok_p = (top_p[:, None] >= 1.0) | (mass < top_p[:, None])
    t_k = jnp.where(top_k <= 0, jnp.uint32(0), _lowest_allowed(ok_k, list_keys))  # 0: every key passes
    t_p = jnp.where(top_p >= 1.0, jnp.uint32(0), _lowest_allowed(ok_p, list_keys))
    # Where even the lowest listed score passes, that part's threshold may lie below the list: bisect it, unless
    # the other part's threshold is in the list (then that one is the larger).
    below_k = ok_k[:, -1] & (top_k > 0) & (cap < vocab)
    below_p = ok_p[:, -1] & (top_p < 1.0) & (cap < vocab)
    below_k, below_p = below_k & ((top_p >= 1.0) | below_p), below_p & ((top_k <= 0) | below_k)

    def one_row(row: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        keys, probs, top_k, top_p, hi, below_k, below_p, listed_k, listed_p = row

        def count_ok(above: jax.Array) -> jax.Array:
            return jnp.sum(above) < top_k

        def mass_ok(above: jax.Array) -> jax.Array:
            return jnp.sum(jnp.where(above, probs, 0.0)) < top_p

        t_k = jax.lax.cond(below_k, lambda: _bisect(count_ok, keys, hi), lambda: listed_k)
        return t_k, jax.lax.cond(below_p, lambda: _bisect(mass_ok, keys, hi), lambda: listed_p)

    t_k, t_p = jax.lax.cond(
        jnp.any(below_k | below_p),
        lambda: jax.lax.map(one_row, (keys, probs, top_k, top_p, list_keys[:, -1], below_k, below_p, t_k, t_p)),
        lambda: (t_k, t_p),
    )
    keep = keys >= jnp.maximum(t_k, t_p)[:, None]
    keep &= probs >= min_p[:, None] * list_probs[:, :1]  # the first listed is the most likely
    return keep | (keys == list_keys[:, :1])  # and it always survives


def _lowest_allowed(ok: jax.Array, list_keys: jax.Array) -> jax.Array:
    """Per row, the lowest listed key that passes (`ok` [S, cap]); the highest if none does: [S] u32."""
    return jnp.min(jnp.where(ok, list_keys, list_keys[:, :1]), axis=-1)


def _bisect(passes: Callable[[jax.Array], jax.Array], keys: jax.Array, hi: jax.Array) -> jax.Array:
    """One row: the smallest order key t in [min(keys), hi] for which `passes(keys > t)` holds (it holds at hi,
    and for every t above one where it holds), for `keys` [V]: at most 32 masked reductions over the row."""

    def step(lo_hi: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = lo_hi
        mid = lo + (hi - lo) // 2
        ok = passes(keys > mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    return jax.lax.while_loop(lambda lo_hi: lo_hi[0] < lo_hi[1], step, (jnp.min(keys), hi))[1]


def _row_keys(meta: SamplingMeta) -> jax.Array:
    """One PRNG key per row from the request's seed and the index of the token being drawn: [S] keys."""

    def one(seed: jax.Array, step: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
        return jax.random.fold_in(key, step)

    return jax.vmap(one)(meta.seed, meta.step)


def row_uniforms(meta: SamplingMeta) -> jax.Array:
    """The two uniforms in [0, 1) each row's draw uses (`categorical`): [S, 2] f32."""
    return jax.vmap(lambda key: jax.random.uniform(key, (2,), jnp.float32))(_row_keys(meta))


def first_argmax(x: jax.Array, block: int = BLOCK) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` for x [S, V], exactly (the first index of the largest; a NaN counts as the
    largest): [S] i32. One vectorized pass takes the max of each `block` of consecutive entries; argmax then
    runs over those maxima and over the one block holding the first of them. XLA:CPU's argmax over [S, V] is a
    variadic reduce that does not vectorize (measured at 32 x 32,000 on 2 cores: 3.2 ms against 0.7 ms)."""
    rows, vocab = x.shape
    blocks = -(-vocab // block)
    x = jnp.pad(x, ((0, 0), (0, blocks * block - vocab)), constant_values=-jnp.inf).reshape(rows, blocks, block)
    block_max = jnp.where(jnp.any(jnp.isnan(x), axis=-1), jnp.nan, jnp.max(x, axis=-1))  # XLA:CPU's max skips NaN
    b = jnp.argmax(block_max, axis=-1).astype(jnp.int32)
    inside = jnp.take_along_axis(x, b[:, None, None], axis=1)[:, 0]  # [S, block]
    return b * block + jnp.argmax(inside, axis=-1).astype(jnp.int32)


def _first_above(cum: jax.Array, target: jax.Array, weights: jax.Array) -> jax.Array:
    """Per row of cum [R, N] (running sums of `weights` [R, N] >= 0): the first index whose running sum exceeds
    target [R], never past the last index with positive weight (rounding can leave target >= the last sum)."""
    count = jnp.sum(cum <= target[:, None], axis=-1, dtype=jnp.int32)
    iota = jax.lax.broadcasted_iota(jnp.int32, weights.shape, 1)
    last = jnp.max(jnp.where(weights > 0, iota, 0), axis=-1)
    return jnp.minimum(count, last)


def categorical(weights: jax.Array, u: jax.Array, block: int = BLOCK) -> jax.Array:
    """One draw per row from weights [S, V] (>= 0, each row with a positive entry), by inverse CDF: [S] i32.

    Two stages, each exact: a block of `block` consecutive tokens with probability proportional to its weight
    (its running sum over blocks against u[:, 0] x the row's total), then a token within it with probability
    proportional to its weight (u[:, 1] against the block's running sum), so token j is drawn with probability
    weight_j / total. A token of weight 0 (filtered, suppressed, padding) is never drawn. Only the [S, V / block]
    block sums and one [S, block] slice per row are scanned, where a cumulative sum over [S, V] costs as much as
    the whole draw; the second uniform gives the within-block choice float32 resolution relative to its block,
    not to the row's total. u [S, 2] f32 in [0, 1).
    """
    rows, vocab = weights.shape
    blocks = -(-vocab // block)
    w = jnp.pad(weights, ((0, 0), (0, blocks * block - vocab))).reshape(rows, blocks, block)
    block_mass = jnp.sum(w, axis=-1)  # [S, blocks]
    block_cum = jnp.cumsum(block_mass, axis=-1)
    b = _first_above(block_cum, u[:, 0] * block_cum[:, -1], block_mass)
    inside = jnp.take_along_axis(w, b[:, None, None], axis=1)[:, 0]  # [S, block]
    cum = jnp.cumsum(inside, axis=-1)
    j = _first_above(cum, u[:, 1] * cum[:, -1], inside)
    return b * block + j


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The logprob of `tokens` [N] under logits [N, V] f32 and the `k` most likely (ids, logprobs) of each row:
    ([N] f32, [N, k] i32, [N, k] f32). The one logprob computation, for sampled rows and prompt positions
    (`paged_jax.worker.prompt_logprobs`) alike."""
    logprob = chosen_logprob(logits, tokens)
    if not k:
        return logprob, jnp.zeros((logits.shape[0], 0), jnp.int32), jnp.zeros((logits.shape[0], 0), jnp.float32)
    top_lp, top_ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), min(k, logits.shape[1]))
    return logprob, top_ids.astype(jnp.int32), top_lp


def chosen_logprob(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log softmax(logits)[token] per row without building the [S, V] log-softmax: [S] f32. The same formula
    as `jax.nn.log_softmax` ((x - max) - log sum exp(x - max)), evaluated at one entry."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    log_total = jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1))
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return (picked - top[:, 0]) - log_total


@partial(jax.jit, static_argnames=("do_sample", "do_filter", "do_penalty", "want_logprobs"))
def sample(
    logits: jax.Array,
    meta: SamplingMeta,
    bitmask: jax.Array | None = None,
    *,
    do_sample: bool,
    do_filter: bool,
    do_penalty: bool,
    want_logprobs: bool,
) -> SamplerOutput:
    """Pick one token per row. `logits` [S, V] float32. The static flags select the cheapest variant.

    Scores are the logits plus the logit bias (when `meta` has bias columns), then penalties. Greedy rows
    (temperature < `MIN_TEMPERATURE`) take the first highest score after the ban list. Sampled rows draw from
    softmax(scores / temperature) restricted to what the filters keep (`categorical` with `row_uniforms`).
    `bitmask` (int32 [S, ceil(V / 32)], `paged_jax.structured.bitmask`): the tokens a structured-output row may
    take; everything downstream (bias, penalties, greedy, filters, the draw, logprobs) sees the masked
    distribution, so a disallowed token is never chosen. Logprobs are otherwise those of the raw logits (no
    bias, penalties or temperature: vLLM's default).
    """
    logits = logits.astype(jnp.float32)
    num_rows, vocab = logits.shape
    if bitmask is not None:
        logits = apply_bitmask(logits, bitmask)
    x = logits
    if meta.logit_bias_ids.shape[1]:
        x = apply_logit_bias(x, meta.logit_bias_ids, meta.logit_bias)
    x = _apply_penalties(x, meta) if do_penalty else x
    if bitmask is not None and do_penalty:  # a penalty can lift a masked score (MASK / a repetition penalty)
        x = apply_bitmask(x, bitmask)
    suppress = jnp.where(meta.suppress >= 0, meta.suppress, vocab)
    rows = jnp.arange(num_rows)[:, None]
    x = x.at[rows, suppress].set(MASK, mode="drop")
    if do_sample:
        hot = meta.temperature >= MIN_TEMPERATURE
        temp = jnp.where(hot, meta.temperature, 1.0)
        # Masked again after scaling: MASK / a huge temperature is close to 0, which would let a suppressed
        # token (EOS under min_tokens) back in.
        y = (x / temp[:, None]).at[rows, suppress].set(MASK, mode="drop")
        if bitmask is not None:  # likewise a token the bitmask masked (its score is exactly MASK)
            y = jnp.where(x == MASK, MASK, y)
        tokens = first_argmax(y)  # the greedy rows' pick: their y is x (divided by 1)
        weights = jnp.exp(y - jnp.max(y, axis=-1, keepdims=True))  # a suppressed token's is exactly 0
        if do_filter:
            probs = weights / jnp.sum(weights, axis=-1, keepdims=True)  # softmax(y), as jax.nn.softmax has it
            weights = jnp.where(filter_mask(y, probs, meta.top_k, meta.top_p, meta.min_p), weights, 0.0)
        sampled = categorical(weights, row_uniforms(meta))
        tokens = jnp.where(hot, sampled, tokens)
    else:
        tokens = first_argmax(x)
    logprob, top_ids, top_lp = token_logprobs(logits, tokens, MAX_LOGPROBS if want_logprobs else 0)
    return SamplerOutput(tokens, logprob, top_ids, top_lp)


def empty_meta(
    num_rows: int, suppress_width: int = 8, history_len: int = 1, logit_bias_width: int = 0
) -> dict[str, np.ndarray]:
    """Host-side numpy buffers for a `SamplingMeta`, filled with neutral values."""
    return {
        "temperature": np.zeros(num_rows, np.float32),
        "top_k": np.zeros(num_rows, np.int32),
        "top_p": np.ones(num_rows, np.float32),
        "min_p": np.zeros(num_rows, np.float32),
        "repetition_penalty": np.ones(num_rows, np.float32),
        "presence_penalty": np.zeros(num_rows, np.float32),
        "frequency_penalty": np.zeros(num_rows, np.float32),
        "seed": np.zeros((num_rows, 2), np.uint32),
        "step": np.zeros(num_rows, np.int32),
        "suppress": np.full((num_rows, suppress_width), -1, np.int32),
        "history": np.full((num_rows, history_len), -1, np.int32),
        "num_prompt": np.zeros(num_rows, np.int32),
        "logit_bias_ids": np.full((num_rows, logit_bias_width), -1, np.int32),
        "logit_bias": np.zeros((num_rows, logit_bias_width), np.float32),
    }
