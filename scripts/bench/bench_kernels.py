"""CPU benchmark of the paged-attention paths: against dense attention, against the memory bandwidth, against the
matmul FLOP floor.

``--section dense``: decode (one query per sequence, every sequence at full context) and prefill (one prompt,
causal), both on the pages in random physical order. Dense runs on contiguous ``[batch, len, heads, dim]`` K/V,
both as ``jax.nn.dot_product_attention`` ("sdpa") and as the plain grouped-query einsum; paged is
:func:`pallas_kernels.ragged_paged_attention` with ``backend="xla"`` and ``backend="cpu"``
(:mod:`pallas_kernels.cpu.paged`). The ratios are each paged path's time over the faster dense one (the goal of
paging: at most 1.2x).

``--section bandwidth``: decode over a KV cache far larger than the caches (batch 32, and batch 1 at a long
context), each ISA path of the C++ kernel; GB/s of KV read (K + V bytes of every visible key, scales included)
beside a STREAM read and copy (``scripts/bench/bench_bandwidth.py``) measured in the same run, by wall time and per
CPU-second (bytes over the process's CPU seconds per thread: on cores shared with other work that moves far less
with their load than wall time does). The paths' calls alternate, best of ``--iters`` each (as STREAM counts its
runs). ``--baseline old=SAVED.so`` times a saved build of the kernel (e.g. of an older commit, copied out of the
kernel cache before the edit) beside the current ones on the same operands; ``--rounds`` repeats the whole
table, STREAM included.

``--section prefill``: prefill attention (the kernel's blocked matrix products) against the matmul FLOP floor of
the same shapes (``4 * visible (query, key) pairs * head_dim * heads`` FLOPs at the peak of a large float32
matmul measured in the same run).

    .venv/bin/python scripts/bench/bench_kernels.py [--section dense|bandwidth|prefill] [--iters 5] [--quick]
        [--rounds 3] [--dtypes float32,bfloat16] [--baseline old=SAVED.so]
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import ragged_paged_attention
from pallas_kernels.common import kv_pages_shape
from pallas_kernels.cpu import paged as cpu_paged
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


def dense_section(args: argparse.Namespace) -> None:
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
    print(f"{'case':55s} {'sdpa':>8s} {'einsum':>8s} {'xla':>8s} {'cpu':>8s} {'xla/dense':>8s} {'cpu/dense':>8s}")
    for name, kw in cases:
        run_case(name, iters=args.iters, dtype=f32, **kw)


def timed(fn, *args, iters: int) -> tuple[float, float]:
    """(median wall, median process CPU) seconds of ``fn(*args)`` over `iters` calls after a warm-up call."""
    jax.block_until_ready(fn(*args))
    walls, cpus = [], []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(*args))
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return float(np.median(walls)), float(np.median(cpus))


def decode_case(batch: int, context: int, q_heads: int, kv_heads: int, d: int, page: int, dtype, seed: int = 0):
    """Decode operands (one query per sequence, `context` keys each) over pages in random physical order, and the
    KV bytes one call reads."""
    rng = np.random.default_rng(seed)
    blocks = -(-context // page)
    num_pages = batch * blocks + 1
    tables = (rng.permutation(num_pages - 1) + 1).astype(np.int32).reshape(batch, blocks)
    shape = kv_pages_shape(num_pages, kv_heads, page, d)
    kv_dtype = jnp.dtype(dtype)
    if kv_dtype in (jnp.int8, jnp.float8_e4m3fn):
        from pallas_kernels import kv_quant

        pages = kv_quant.quantize_pages(jax.random.normal(jax.random.key(seed), shape, jnp.float32), kv_dtype)
        q_dtype, per_key = jnp.float32, 2 * d * kv_dtype.itemsize + 8
    else:
        pages = jax.random.normal(jax.random.key(seed), shape, kv_dtype)
        q_dtype, per_key = kv_dtype, 2 * d * kv_dtype.itemsize
    q = jax.random.normal(jax.random.key(seed + 1), (batch, q_heads, d), q_dtype)
    args = (
        q,
        pages,
        jnp.full((batch,), context, jnp.int32),
        jnp.asarray(tables),
        jnp.arange(batch + 1, dtype=jnp.int32),
        jnp.array([batch], jnp.int32),
    )
    return args, batch * context * kv_heads * per_key


def bandwidth_section(args: argparse.Namespace) -> None:
    from bench_bandwidth import stream

    threads = os.cpu_count() or 1
    mib = 256 if args.quick else 512
    ctx = 1 if args.quick else 2
    cases = [
        (
            "decode b32 q32/kv8 d128 ctx2048 page16",
            dict(batch=32, context=1024 * ctx, q_heads=32, kv_heads=8, d=128, page=16),
        ),
        (
            "decode b1 q32/kv8 d128 ctx32k page16",
            dict(batch=1, context=16384 * ctx, q_heads=32, kv_heads=8, d=128, page=16),
        ),
        (
            "decode b1 q8/kv1 d64 ctx64k page16 (split KV)",
            dict(batch=1, context=32768 * ctx, q_heads=8, kv_heads=1, d=64, page=16),
        ),
    ]
    kernels = {i: cpu_paged.kernel(i) for i in ("native", "avx2") if cpu_paged.available(i)}
    for spec in args.baseline:  # saved builds (e.g. of an older commit), timed beside the current ones
        label, _, path = spec.partition("=")
        kernels[label] = cpu_paged.load(Path(path), f"paged_jax_bench_{label}")
    print("paths: " + ", ".join(f"{name} = {k.isa} ({k.library.name})" for name, k in kernels.items()))
    for r in range(args.rounds):
        print(f"-- round {r + 1}: load average {os.getloadavg()[0]:.1f} before; {threads} CPUs; STREAM {mib} MiB")
        ref = stream(threads, mib, reps=3)
        for name in ("read", "copy"):
            print(
                f"STREAM {name:5s} ({threads} threads): {ref[name].wall:6.1f} GB/s wall, "
                f"{ref[name].cpu:6.1f} per CPU-second"
            )
        print(
            f"{'case':48s} {'dtype':>9s} {'path':>10s} {'MB':>7s} {'ms':>8s} {'GB/s':>6s} {'/read':>6s} "
            f"{'CPU GB/s':>9s} {'/read':>6s} {'load':>5s}"
        )
        for case, kw in cases:
            for dtype in args.dtypes.split(","):
                operands, nbytes = decode_case(**kw, dtype=dtype)
                fns = {
                    name: jax.jit(functools.partial(_kernel_call, sm_scale=kw["d"] ** -0.5, kernel=k))
                    for name, k in kernels.items()
                }
                for name, (wall, cpu) in best_interleaved(fns, operands, iters=args.iters).items():
                    gbs, cpu_gbs = nbytes / wall / 1e9, nbytes / (cpu / threads) / 1e9
                    print(
                        f"{case:48s} {dtype:>9s} {name:>10s} {nbytes / 1e6:7.0f} {wall * 1e3:8.2f} {gbs:6.1f} "
                        f"{gbs / ref['read'].wall:6.0%} {cpu_gbs:9.1f} {cpu_gbs / ref['read'].cpu:6.0%} "
                        f"{os.getloadavg()[0]:5.1f}",
                        flush=True,
                    )
                del operands


def best_interleaved(fns: dict, args: tuple, iters: int) -> dict[str, tuple[float, float]]:
    """(best wall, best process CPU) seconds of each ``fn(*args)`` over `iters` rounds in which every fn runs
    once, in turn (so other work on shared cores slows them alike), after a warm-up call each; best, as STREAM
    counts its runs: other processes only ever slow a call down."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    walls: dict[str, list[float]] = {name: [] for name in fns}
    cpus: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*args))
            walls[name].append(time.perf_counter() - t0)
            cpus[name].append(time.process_time() - c0)
    return {name: (min(walls[name]), min(cpus[name])) for name in fns}


def _kernel_call(q, pages, *rest, sm_scale: float, kernel: cpu_paged.Kernel):
    from pallas_kernels import kv_quant

    pages, scales = kv_quant.split(pages)
    return cpu_paged.call(kernel, q, pages, *rest, sm_scale=sm_scale, kv_scales=scales)


def prefill_section(args: argparse.Namespace) -> None:
    threads = os.cpu_count() or 1
    n = 1024 if args.quick else 2048
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    mm = jax.jit(lambda x, y: x @ y)
    wall, cpu = timed(mm, a, a, iters=args.iters)
    peak_wall, peak_cpu = 2 * n**3 / wall, 2 * n**3 / (cpu / threads)
    print(
        f"load average {os.getloadavg()[0]:.1f}; float32 matmul {n}^3 peak: {peak_wall / 1e9:.1f} GFLOP/s wall, "
        f"{peak_cpu / 1e9:.1f} per CPU-second x {threads} threads"
    )
    s = 2 if args.quick else 1
    cases = [
        ("prefill 1x1024 q8/kv2 d64 page16", dict(batch=1, q_len=1024 // s, q_heads=8, kv_heads=2, d=64, page=16)),
        ("prefill 4x256 q32/kv8 d128 page32", dict(batch=4, q_len=256 // s, q_heads=32, kv_heads=8, d=128, page=32)),
        ("prefill 1x2048 q32/kv8 d128 page16", dict(batch=1, q_len=2048 // s, q_heads=32, kv_heads=8, d=128, page=16)),
    ]
    isas = [i for i in ("native", "avx2") if cpu_paged.available(i)]
    print(
        f"{'case':40s} {'dtype':>9s} {'path':>7s} {'ms':>8s} {'floor ms':>8s} {'x floor':>7s} "
        f"{'CPU x floor':>11s} {'load':>5s}"
    )
    for name, kw in cases:
        b, t, hq, hk, d, page = (kw[k] for k in ("batch", "q_len", "q_heads", "kv_heads", "d", "page"))
        pairs = b * t * (t + 1) // 2
        flops = 4 * pairs * d * hq
        for dtype in (jnp.float32, jnp.bfloat16):
            keys = jax.random.split(jax.random.key(1), 3)
            k = jax.random.normal(keys[1], (b, t, hk, d), dtype)
            v = jax.random.normal(keys[2], (b, t, hk, d), dtype)
            pages, tables = paged_from_dense(k, v, page, max_seqs=b)
            q = jax.random.normal(keys[0], (b * t, hq, d), dtype)
            rest = (
                jnp.full((b,), t, jnp.int32),
                tables,
                jnp.arange(b + 1, dtype=jnp.int32) * t,
                jnp.array([b], jnp.int32),
            )
            for isa in isas:
                fn = jax.jit(functools.partial(_kernel_call, sm_scale=d**-0.5, kernel=cpu_paged.kernel(isa)))
                wall, cpu = timed(fn, q, pages, *rest, iters=args.iters)
                floor = flops / peak_wall
                print(
                    f"{name:40s} {jnp.dtype(dtype).name:>9s} {isa:>7s} {wall * 1e3:8.2f} {floor * 1e3:8.2f} "
                    f"{wall / floor:7.2f} {(cpu / threads) / (flops / peak_cpu):11.2f} {os.getloadavg()[0]:5.1f}",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=("dense", "bandwidth", "prefill", "all"), default="all")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    parser.add_argument("--rounds", type=int, default=1, help="bandwidth: repeat the table (STREAM included)")
    parser.add_argument("--dtypes", default="float32,bfloat16,int8", help="bandwidth: page dtypes, comma-separated")
    parser.add_argument(
        "--baseline",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="bandwidth: also time a saved build of the kernel (.so, e.g. from an older commit) as path LABEL",
    )
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {args.iters} iters (bandwidth: best, else median)")
    for name, section in (("dense", dense_section), ("bandwidth", bandwidth_section), ("prefill", prefill_section)):
        if args.section in (name, "all"):
            print(f"\n== {name} ==")
            section(args)


if __name__ == "__main__":
    main()
