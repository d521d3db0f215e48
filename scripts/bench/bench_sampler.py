"""The on-device sampler, old against new, side by side in one process: greedy, temperature sampling and
top-k + top-p (and top-p alone) filtering of S rows of float32 logits.

"old" is `paged_jax.worker.sampler.sample` as it was on `main` before the sampler branch (Gumbel-max over V threefry
uniforms per row, a full [S, V] log-softmax for the chosen token's logprob, `jnp.argmax`), copied below unchanged
(but for the pieces the new one kept, imported from it) so that both run in the same process on the same inputs.
Reference rows measure the alternatives tried for the sampled path (Gumbel-max with JAX's `rbg` / `unsafe_rbg` key
implementations instead of threefry). Rounds are interleaved (each variant `--reps` calls, then the next, `--rounds`
times) so that load drifting on a shared machine hits every variant alike; the table gives the fastest wall time,
the median CPU time (`time.process_time`: all threads of this process, which moves far less with other jobs' load)
and the ratio old / variant of the median CPU times (> 1: faster than old).

    python scripts/bench/bench_sampler.py [--rows 32] [--vocab 32000 49152] [--reps 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.sampling_params import MAX_LOGPROBS
from paged_jax.worker import xla_flags
from paged_jax.worker.sampler import MIN_TEMPERATURE, SamplerOutput, SamplingMeta, empty_meta, sample
from paged_jax.worker.sampler import _apply_penalties as _old_apply_penalties  # the same in both
from paged_jax.worker.sampler import _order_keys as _old_order_keys  # the same in both
from pallas_kernels.common import MASK_VALUE as MASK

# ---- the old sampler (main at d669d3f, paged_jax/worker/sampler.py), unchanged but for names and the key impl;
# its penalties and its float -> ordered-key map are the new sampler's, imported above ----


def old_filter_mask(y: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    keys = _old_order_keys(y)
    probs = jax.nn.softmax(y, axis=-1)
    top = jnp.max(keys, axis=-1)
    threshold = jax.lax.map(lambda row: _old_threshold(*row), (keys, probs, top_k, top_p))
    keep = keys >= threshold[:, None]
    keep &= probs >= min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return keep | (keys == top[:, None])


def _old_threshold(keys: jax.Array, probs: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    def allowed(t: jax.Array) -> jax.Array:
        above = keys > t
        ok_k = (top_k <= 0) | (jnp.sum(above) < top_k)
        return ok_k & ((top_p >= 1.0) | (jnp.sum(jnp.where(above, probs, 0.0)) < top_p))

    def bisect(_, lo_hi):
        lo, hi = lo_hi
        mid = lo + (hi - lo) // 2
        ok = allowed(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    return jax.lax.fori_loop(0, 32, bisect, (jnp.min(keys), jnp.max(keys)))[1]


def _old_row_keys(meta: SamplingMeta, impl: str | None) -> jax.Array:
    def one(seed: jax.Array, step: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(seed[0], impl=impl), seed[1])
        return jax.random.fold_in(key, step)

    return jax.vmap(one)(meta.seed, meta.step)


@partial(jax.jit, static_argnames=("do_sample", "do_filter", "do_penalty", "want_logprobs", "impl"))
def old_sample(
    logits: jax.Array,
    meta: SamplingMeta,
    *,
    do_sample: bool,
    do_filter: bool,
    do_penalty: bool,
    want_logprobs: bool,
    impl: str | None = None,
) -> SamplerOutput:
    """The old `sample`; `impl` (a `jax.random.key` implementation; None: threefry, the old default) is only
    for the reference rows."""
    logits = logits.astype(jnp.float32)
    num_rows, vocab = logits.shape
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    x = _old_apply_penalties(logits, meta) if do_penalty else logits
    suppress = jnp.where(meta.suppress >= 0, meta.suppress, vocab)
    rows = jnp.arange(num_rows)[:, None]
    x = x.at[rows, suppress].set(MASK, mode="drop")
    tokens = jnp.argmax(x, axis=-1).astype(jnp.int32)
    if do_sample:
        hot = meta.temperature >= MIN_TEMPERATURE
        temp = jnp.where(hot, meta.temperature, 1.0)
        y = (x / temp[:, None]).at[rows, suppress].set(MASK, mode="drop")
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(_old_row_keys(meta, impl))
        if do_filter:
            keep = old_filter_mask(y, meta.top_k, meta.top_p, meta.min_p)
            sampled = jnp.argmax(jnp.where(keep, y + gumbel, MASK), axis=-1)
        else:
            sampled = jnp.argmax(y + gumbel, axis=-1)
        tokens = jnp.where(hot, sampled.astype(jnp.int32), tokens)
    logprob = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    if want_logprobs:
        top_lp, top_ids = jax.lax.top_k(raw_logprobs, min(MAX_LOGPROBS, vocab))
    else:
        top_lp = jnp.zeros((num_rows, 0), jnp.float32)
        top_ids = jnp.zeros((num_rows, 0), jnp.int32)
    return SamplerOutput(tokens, logprob, top_ids.astype(jnp.int32), top_lp)


# ---- the benchmark ----


def sampling_meta(rows: int, mode: str) -> SamplingMeta:
    """As `scripts/bench/profile_decode.py` sets it: temperature 0.8, one seed per row, "filter": top-k 50 and top-p
    0.9; "top-p": top-p 0.95 alone (on these logits most rows' nucleus is larger than the 64 highest scores, so
    the new filter bisects them: its slow path)."""
    m = empty_meta(rows)
    if mode != "greedy":
        m["temperature"][:] = 0.8
        m["seed"][:, 0] = np.arange(rows)
    if mode == "filter":
        m["top_k"][:], m["top_p"][:] = 50, 0.9
    if mode == "top-p":
        m["top_p"][:] = 0.95
    return SamplingMeta(**{k: jnp.asarray(v) for k, v in m.items()})


def variants(mode: str) -> dict[str, Callable]:
    flags = dict(
        do_sample=mode != "greedy", do_filter=mode in ("filter", "top-p"), do_penalty=False, want_logprobs=False
    )
    out = {"old": partial(old_sample, **flags), "new": partial(sample, **flags)}
    if mode == "sample":
        out["old, rbg keys"] = partial(old_sample, **flags, impl="rbg")
        out["old, unsafe_rbg keys"] = partial(old_sample, **flags, impl="unsafe_rbg")
    return out


def measure(fns: dict[str, Callable], args: tuple, reps: int, rounds: int) -> dict[str, tuple[float, float]]:
    """(fastest wall ms, median CPU ms) per variant over `rounds` interleaved rounds of `reps` calls each."""
    for fn in fns.values():
        for _ in range(2):
            jax.block_until_ready(fn(*args))
    walls: dict[str, list[float]] = {name: [] for name in fns}
    cpus: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(reps):
                t0, c0 = time.perf_counter(), time.process_time()
                jax.block_until_ready(fn(*args))
                walls[name].append(time.perf_counter() - t0)
                cpus[name].append(time.process_time() - c0)
    return {name: (min(walls[name]) * 1e3, float(np.median(cpus[name])) * 1e3) for name in fns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 49152])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    xla_flags.log_settings()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'V':>6s} {'mode':7s} {'variant':22s} {'wall ms min':>11s} {'CPU ms median':>13s} {'old / variant':>13s}")
    for vocab in args.vocab:
        rng = np.random.default_rng(vocab)
        logits = jnp.asarray(rng.standard_normal((args.rows, vocab)) * 3, jnp.float32)
        for mode in ("greedy", "sample", "filter", "top-p"):
            res = measure(variants(mode), (logits, sampling_meta(args.rows, mode)), args.reps, args.rounds)
            old_cpu = res["old"][1]
            for name, (wall, cpu) in res.items():
                print(f"{vocab:6d} {mode:7s} {name:22s} {wall:11.2f} {cpu:13.2f} {old_cpu / cpu:12.2f}x")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
