"""CPU benchmark: the paged-attention paths of the CPU (XLA, and the C++ kernel) against dense attention.

Decode (one query per sequence, every sequence at full context) and prefill (one prompt, causal), both on the
pages in random physical order. Dense runs on contiguous ``[batch, len, heads, dim]`` K/V, both as
``jax.nn.dot_product_attention`` ("sdpa") and as the plain grouped-query einsum; paged is
:func:`pallas_kernels.ragged_paged_attention` with ``backend="xla"`` and ``backend="cpu"``
(:mod:`pallas_kernels.cpu_paged`). The ratios are each paged path's time over the faster dense one (the goal of
paging: at most 1.2x).

    .venv/bin/python scripts/bench_kernels.py [--iters 5] [--quick]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import ragged_paged_attention
from pallas_kernels.common import kv_pages_shape
from pallas_kernels.testing import assert_close, median_seconds


def bench(fn, *args, iters: int) -> float:
    """Median milliseconds after one compile-and-warm-up call."""
    return median_seconds(fn, *args, iters=iters) * 1e3


def paged_from_dense(k, v, page_size: int, max_seqs: int, seed: int = 0):
    """Pages of contiguous K/V ``[batch, len, kv_heads, dim]`` in random physical order, and the tables."""
    b, length, kvh, d = k.shape
    per_seq = length // page_size
    num_pages = b * per_seq + 1
    perm = np.random.default_rng(seed).permutation(num_pages - 1) + 1
    tables = np.zeros((max_seqs, per_seq), np.int32)
    tables[:b] = perm.reshape(b, per_seq)
    kv = jnp.concatenate([k, v], axis=-1).reshape(b, per_seq, page_size, kvh, 2 * d).transpose(0, 1, 3, 2, 4)
    pages = jnp.zeros(kv_pages_shape(num_pages, kvh, page_size, d), k.dtype).at[tables[:b]].set(kv)
    return pages, jnp.asarray(tables)


def run_case(name, *, batch, q_len, length, q_heads, kv_heads, d, page, num_tokens, max_seqs, iters, dtype):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, q_len, q_heads, d), dtype)
    k = jax.random.normal(keys[1], (batch, length, kv_heads, d), dtype)
    v = jax.random.normal(keys[2], (batch, length, kv_heads, d), dtype)
    scale = d**-0.5
    causal = (jnp.arange(length)[None, :] <= (length - q_len + jnp.arange(q_len))[:, None])[None, None]
    dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=causal, scale=scale))

    @jax.jit
    def einsum_dense(q, k, v):  # the plain grouped-query einsum, no repeat of K/V
        qg = q.reshape(batch, q_len, kv_heads, q_heads // kv_heads, d)
        s = jnp.einsum("btkgd,blkd->bkgtl", qg, k, preferred_element_type=jnp.float32) * scale
        p = jax.nn.softmax(jnp.where(causal[:, :, None], s, -1e30), axis=-1)
        o = jnp.einsum("bkgtl,blkd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o.reshape(batch, q_len, q_heads, d).astype(q.dtype)

    pages, tables = paged_from_dense(k, v, page, max_seqs)
    q_flat = jnp.zeros((num_tokens, q_heads, d), dtype).at[: batch * q_len].set(q.reshape(-1, q_heads, d))
    kv_lens = jnp.zeros((max_seqs,), jnp.int32).at[:batch].set(length)
    cu = jnp.asarray(np.minimum(np.arange(max_seqs + 1), batch) * q_len, jnp.int32)
    n = jnp.array([batch], jnp.int32)
    paged = jax.jit(functools.partial(ragged_paged_attention, sm_scale=scale, backend="xla"))
    kernel = jax.jit(functools.partial(ragged_paged_attention, sm_scale=scale, backend="cpu"))
    paged_args = (q_flat, pages, kv_lens, tables, cu, n)

    for fn in (paged, kernel):
        out = fn(*paged_args)[: batch * q_len]
        assert_close(out, dense(q, k, v).reshape(-1, q_heads, d), dtype)
        assert_close(out, einsum_dense(q, k, v).reshape(-1, q_heads, d), dtype)
    t_dense = bench(dense, q, k, v, iters=iters)
    t_einsum = bench(einsum_dense, q, k, v, iters=iters)
    t_paged = bench(paged, *paged_args, iters=iters)
    t_kernel = bench(kernel, *paged_args, iters=iters)
    best_dense = min(t_dense, t_einsum)
    print(
        f"{name:55s} {t_dense:8.2f} {t_einsum:8.2f} {t_paged:8.2f} {t_kernel:8.2f} {t_paged / best_dense:7.2f}x "
        f"{t_kernel / best_dense:7.2f}x",
        flush=True,
    )
    return t_kernel / best_dense


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    args = parser.parse_args()
    f32 = jnp.float32
    s = 2 if args.quick else 1
    cases = [
        (
            "decode b16 q32/kv8 d128 ctx2048 page16 f32",
            dict(
                batch=16,
                q_len=1,
                length=2048 // s,
                q_heads=32,
                kv_heads=8,
                d=128,
                page=16,
                num_tokens=16,
                max_seqs=16,
            ),
        ),
        (
            "decode b64 q8/kv2 d64 ctx1024 page16 f32 (bucket 64)",
            dict(
                batch=64,
                q_len=1,
                length=1024 // s,
                q_heads=8,
                kv_heads=2,
                d=64,
                page=16,
                num_tokens=64,
                max_seqs=64,
            ),
        ),
        (
            "decode b8 of bucket 32 q32/kv8 d128 ctx2048 page16 f32",
            dict(
                batch=8,
                q_len=1,
                length=2048 // s,
                q_heads=32,
                kv_heads=8,
                d=128,
                page=16,
                num_tokens=32,
                max_seqs=32,
            ),
        ),
        (
            "prefill 1x1024 q8/kv2 d64 page16 f32",
            dict(
                batch=1,
                q_len=1024 // s,
                length=1024 // s,
                q_heads=8,
                kv_heads=2,
                d=64,
                page=16,
                num_tokens=1024 // s,
                max_seqs=8,
            ),
        ),
        (
            "prefill 4x256 q32/kv8 d128 page32 f32",
            dict(
                batch=4,
                q_len=256,
                length=256,
                q_heads=32,
                kv_heads=8,
                d=128,
                page=32,
                num_tokens=1024,
                max_seqs=8,
            ),
        ),
    ]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {args.iters} iters, median ms")
    print(f"{'case':55s} {'sdpa':>8s} {'einsum':>8s} {'xla':>8s} {'cpu':>8s} {'xla/dense':>8s} {'cpu/dense':>8s}")
    for name, kw in cases:
        run_case(name, iters=args.iters, dtype=f32, **kw)


if __name__ == "__main__":
    main()
