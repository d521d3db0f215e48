"""One prepared check of the GPU paged-attention kernel on an NVIDIA GPU (made for an H200; < 5 minutes).

1. Copy bandwidth of the card (device-to-device copy of 4 GiB, read + write counted).
2. Correctness: the Triton kernel against the dense reference on random mixed batches (decode, chunked
   prefill, prefill, empty sequences, GQA/MQA, head_dim 64/128/256, several page sizes, float32 and bfloat16,
   sliding window, soft cap, explicit and adaptive split-KV), with unused memory poisoned with NaN.
3. Timing, each case next to the work model's estimate (``gpu_work``: max(bytes / 4.8 TB/s, FLOPs / 989
   TFLOP/s) on H200) and the plan it ran (q-block tokens, splits, programs):
   - decode, batch 64, 32 query / 8 KV heads, head_dim 128, context 4096, bfloat16, page 16 and 64 (1.07 GB of
     KV), side by side with ``jax.experimental.pallas.ops.gpu.paged_attention`` and
     ``jax.nn.dot_product_attention`` on contiguous KV;
   - decode, batch 4 and batch 1 at context 32k (split-KV) with the adaptive splits and with one split forced;
   - a mixed step (48 decodes + a 464-token chunk) in the plan's two launches and in one;
   - chunked prefill, 8 sequences x 512 new tokens on 4096 context.
   One table: microseconds, percent of measured bandwidth, the model's microseconds, ratio to each peer.

    .venv/bin/python scripts/gpu_check.py              # on the GPU machine
    .venv/bin/python scripts/gpu_check.py --interpret  # correctness half only, Pallas interpreter, on CPU
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dense_reference_attention
from pallas_kernels.common import cdiv, kv_pages_shape
from pallas_kernels.gpu_plan import gpu_plan_for, gpu_work_detail
from pallas_kernels.gpu_ragged_paged_attention import ragged_paged_attention_gpu
from pallas_kernels.testing import assert_close, make_case, median_seconds, random_seqs
from pallas_kernels.work_model import HARDWARE

# batch, q heads, kv heads, head_dim, context, page size, dtype: 1.07 GB of KV, ~250 us at 4.3 TB/s.
DECODE = (64, 32, 8, 128, 4096, 16, jnp.bfloat16)
LONG = (4, 32, 8, 128, 32768, 16, jnp.bfloat16)  # small batch, long context: split-KV
CHUNKED = (8, 512)  # sequences, new tokens each (on DECODE's context)


def bench(fn, *args, iters: int = 20) -> float:
    """Median wall time of ``fn(*args)`` in microseconds, after a compile-and-warm-up call."""
    return median_seconds(fn, *args, iters=iters) * 1e6


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (each byte read once and written once)."""
    x = jnp.ones((1 << 30,), jnp.float32)  # 4 GiB
    copy = jax.jit(lambda a: a + 0)  # read + write, no aliasing
    us = bench(copy, x, iters=10)
    return 2 * x.nbytes / (us * 1e-6)


def correctness(interpret: bool) -> int:
    """Kernel vs dense reference on random batches; returns the number of failing cases."""
    cases = [
        # (seed, dtype, q heads, kv heads, head_dim, page, window, cap, tokens, max_seqs, max_kv)
        (0, jnp.float32, 8, 2, 128, 16, None, None, 64, 8, 80),
        (1, jnp.bfloat16, 32, 8, 128, 16, None, None, 64, 16, 200),
        (2, jnp.bfloat16, 8, 1, 64, 8, None, None, 32, 8, 60),  # MQA
        (3, jnp.float32, 8, 8, 256, 32, 20, None, 32, 8, 100),
        (4, jnp.bfloat16, 16, 2, 64, 64, None, 30.0, 64, 8, 150),  # GQA 8
        (5, jnp.bfloat16, 4, 4, 128, 256, 64, 20.0, 32, 8, 300),
        (6, jnp.float32, 12, 4, 64, 128, None, None, 16, 8, 140),  # GQA 3 (padded group)
        (7, jnp.bfloat16, 14, 2, 64, 16, None, None, 16, 8, 3000),  # GQA 7, small batch, long: adaptive splits
        (8, jnp.bfloat16, 32, 8, 128, 64, 1000, 30.0, 8, 8, 5000),  # window + cap with splits
    ]
    if interpret:
        cases = cases[:3]
    failures = 0
    for seed, dtype, qh, kvh, d, page, window, cap, tokens, max_seqs, max_kv in cases:
        rng = np.random.default_rng(seed)
        seqs = random_seqs(rng, tokens, max_seqs, max_kv)
        case = make_case(
            seed,
            seqs,
            num_tokens=tokens,
            max_seqs=max_seqs,
            num_q_heads=qh,
            num_kv_heads=kvh,
            head_dim=d,
            page_size=page,
            dtype=dtype,
        )
        opts = dict(sm_scale=d**-0.5, soft_cap=cap, sliding_window=window)
        ref = dense_reference_attention(*case.dense_args, **opts)
        for splits in (None, 3):  # the plan's own choice, then three splits forced
            name = (
                f"{jnp.dtype(dtype).name} q{qh} kv{kvh} d{d} page{page} window={window} cap={cap} "
                f"splits={splits or 'plan'} seqs={seqs}"
            )
            try:
                out = ragged_paged_attention_gpu(*case.paged_args, interpret=interpret, num_splits=splits, **opts)
                assert_close(out, ref, dtype)
                print(f"ok   {name}")
            except AssertionError as e:
                failures += 1
                print(f"FAIL {name}\n{str(e)[:600]}")
    return failures


def _decode_inputs(batch: int, q_heads: int, kv_heads: int, d: int, ctx: int, page: int, dtype):
    key = jax.random.key(0)
    kq, kk, kv = jax.random.split(key, 3)
    pages_per_seq = ctx // page
    num_pages = batch * pages_per_seq + 1
    perm = jax.random.permutation(jax.random.key(1), num_pages - 1) + 1  # random physical order
    tables = perm.reshape(batch, pages_per_seq).astype(jnp.int32)
    k = jax.random.normal(kk, (batch, ctx, kv_heads, d), dtype)
    v = jax.random.normal(kv, (batch, ctx, kv_heads, d), dtype)
    # Scatter contiguous K/V into [pages, kv_heads, page, 2 * d] through the tables.
    kv_seq = jnp.concatenate([k, v], axis=-1).reshape(batch, pages_per_seq, page, kv_heads, 2 * d)
    kv_pages = (
        jnp.zeros(kv_pages_shape(num_pages, kv_heads, page, d), dtype).at[tables].set(kv_seq.transpose(0, 1, 3, 2, 4))
    )
    return kq, k, v, kv_pages, tables


def _model(q, kv_pages, lens, tables, cu, n, **overrides) -> tuple[float, str]:
    """The work model's H200 microseconds for this call, and the plan it describes."""
    plan = gpu_plan_for(q.shape, kv_pages.shape, tables.shape[0], tables.shape[1], kv_pages.dtype, q.dtype, **overrides)
    detail = gpu_work_detail(plan, np.asarray(lens), np.asarray(cu), int(n[0]))
    work = detail["work"]
    ranges = "; ".join(
        f"{r.name}: {r.q_block} tok x {plan.group_p} heads, kv step {r.kv_block}, splits {r.num_splits}"
        f"{' (adaptive)' if r.adaptive_splits else ''}"
        for r in plan.ranges
    )
    desc = (
        f"{ranges}; {work.programs} programs, KV {work.kv_bytes_read / 1e6:.0f} MB (min "
        f"{detail['kv_bytes_min'] / 1e6:.0f}), issued {work.issued_flops / 1e9:.1f} GFLOP (useful "
        f"{work.useful_flops / 1e9:.1f})"
    )
    return work.seconds(HARDWARE["h200"]) * 1e6, desc


Row = tuple  # (case, us, fraction of bandwidth or None, model us, plan, {peer: us})


def _decode_rows(shape, bandwidth: float, iters: int, smoke: bool, peers: bool) -> list[Row]:
    from jax.experimental.pallas.ops.gpu import (
        paged_attention as jax_paged,
    )  # deprecated module, still a peer

    b, qh, kvh, d, ctx, page, dtype = shape
    kq, k, v, kv_pages, tables = _decode_inputs(b, qh, kvh, d, ctx, page, dtype)
    q = jax.random.normal(kq, (b, qh, d), dtype)
    lens = jnp.full((b,), ctx, jnp.int32)
    cu = jnp.arange(b + 1, dtype=jnp.int32)
    n = jnp.array([b], jnp.int32)
    dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v, scale=d**-0.5)[:, 0])
    want = dense(q, k, v)
    kv_bytes = 2 * b * ctx * kvh * d * jnp.dtype(dtype).itemsize
    rows = []
    variants = [("plan", {})] + ([("1 split", {"num_splits": 1})] if b * kvh < 264 else [])
    for label, overrides in variants:
        ours = jax.jit(functools.partial(ragged_paged_attention_gpu, sm_scale=d**-0.5, interpret=smoke, **overrides))
        assert_close(ours(q, kv_pages, lens, tables, cu, n), want, dtype)
        t_ours = bench(ours, q, kv_pages, lens, tables, cu, n, iters=iters)
        model_us, desc = _model(q, kv_pages, lens, tables, cu, n, **overrides)
        rows.append(
            (
                f"decode b{b} q{qh} kv{kvh} d{d} ctx{ctx} page{page} [{label}]",
                t_ours,
                kv_bytes / (t_ours * 1e-6) / bandwidth,
                model_us,
                desc,
                {},
            )
        )
    if not peers:
        return rows
    others = {"dense (jax.nn.dot_product_attention)": bench(dense, q, k, v, iters=iters)}
    k_pages = kv_pages[..., :d].transpose(1, 0, 2, 3)  # [kv_heads, pages, page, d]
    v_pages = kv_pages[..., d:].transpose(1, 0, 2, 3)
    q_scaled = (q.astype(jnp.float32) * d**-0.5).astype(dtype)
    for ppcb in (4, 8, 16):
        theirs = jax.jit(
            functools.partial(
                jax_paged.paged_attention,
                pages_per_compute_block=ppcb,
                k_splits=min(16, ctx // page // ppcb),
                interpret=smoke,
            )
        )
        try:
            # JAX's kernel does not scale the logits: scale the queries instead.
            assert_close(theirs(q_scaled, k_pages, v_pages, tables, lens), want, dtype)
            others[f"jax paged_attention (pages/block {ppcb})"] = bench(
                theirs, q_scaled, k_pages, v_pages, tables, lens, iters=iters
            )
        except Exception as e:  # noqa: BLE001 - a peer that fails to run is reported, not fatal
            print(f"peer jax paged_attention pages/block {ppcb} failed: {type(e).__name__}: {str(e)[:200]}")
    rows[0][5].update(others)
    return rows


def _mixed_rows(bandwidth: float, iters: int, smoke: bool) -> list[Row]:
    """A mixed step (48 decode sequences at 2048 keys + one 464-token chunk at 1000 keys, T 512, S 64): the
    plan's two launches (prefill range + decode range) against one launch with the prefill tiling for all."""
    if smoke:
        seqs, tokens, max_seqs, qh, kvh, d, page = [(1, 100)] * 6 + [(26, 60)], 32, 8, 8, 2, 64, 16
    else:
        seqs, tokens, max_seqs, qh, kvh, d, page = [(1, 2048)] * 48 + [(464, 1000)], 512, 64, 32, 8, 128, 16
    case = make_case(
        11,
        seqs,
        num_tokens=tokens,
        max_seqs=max_seqs,
        num_q_heads=qh,
        num_kv_heads=kvh,
        head_dim=d,
        page_size=page,
        dtype=jnp.bfloat16,
    )
    args = case.paged_args
    n = int(case.num_seqs[0])
    kv_bytes = sum(cdiv(kv, page) * page for _, kv in seqs) * kvh * 2 * d * 2
    rows, outs = [], []
    for label, overrides in (("plan: 2 ranges", {}), ("1 range", {"one_range": True})):
        fn = jax.jit(functools.partial(ragged_paged_attention_gpu, sm_scale=d**-0.5, interpret=smoke, **overrides))
        outs.append(np.asarray(fn(*args)[: int(case.cu_q_lens[n])], np.float32))
        t = bench(fn, *args, iters=iters)
        model_us, desc = _model(
            case.q, case.kv_pages, case.kv_lens, case.block_tables, case.cu_q_lens, case.num_seqs, **overrides
        )
        rows.append(
            (
                f"mixed {len(seqs) - 1} decode + {seqs[-1][0]} chunk [{label}]",
                t,
                kv_bytes / (t * 1e-6) / bandwidth,
                model_us,
                desc,
                {},
            )
        )
    np.testing.assert_allclose(outs[0], outs[1], rtol=2e-2, atol=2e-2)  # the two tilings agree
    return rows


def timing(bandwidth: float, smoke: bool = False) -> list[Row]:
    """Rows of (case, our us, our fraction of bandwidth, model us, plan, {peer: peer us}).

    ``smoke``: tiny shapes and every kernel in the Pallas interpreter, to exercise this code path on CPU.
    """
    iters = 1 if smoke else 20
    rows = []
    if smoke:
        rows += _decode_rows((4, 8, 2, 64, 256, 16, jnp.bfloat16), bandwidth, iters, smoke, peers=True)
        rows += _decode_rows((2, 8, 2, 64, 1024, 16, jnp.bfloat16), bandwidth, iters, smoke, peers=False)
    else:
        rows += _decode_rows(DECODE, bandwidth, iters, smoke, peers=True)
        rows += _decode_rows(DECODE[:5] + (64, DECODE[6]), bandwidth, iters, smoke, peers=False)
        rows += _decode_rows(LONG, bandwidth, iters, smoke, peers=False)
        rows += _decode_rows((1,) + LONG[1:], bandwidth, iters, smoke, peers=False)  # one long request

    rows += _mixed_rows(bandwidth, iters, smoke)

    # Chunked prefill: s sequences with `new` new tokens each on ctx keys each.
    _, qh, kvh, d, ctx, page, dtype = (4, 8, 2, 64, 256, 16, jnp.bfloat16) if smoke else DECODE
    s, new = (2, 32) if smoke else CHUNKED
    kq, k, v, kv_pages, tables = _decode_inputs(s, qh, kvh, d, ctx, page, dtype)
    q = jax.random.normal(kq, (s * new, qh, d), dtype)
    lens = jnp.full((s,), ctx, jnp.int32)
    cu = jnp.arange(s + 1, dtype=jnp.int32) * new
    n = jnp.array([s], jnp.int32)
    ours = jax.jit(functools.partial(ragged_paged_attention_gpu, sm_scale=d**-0.5, interpret=smoke))
    out = ours(q, kv_pages, lens, tables, cu, n)
    q_pos = ctx - new + jnp.arange(new)
    mask = (jnp.arange(ctx)[None, :] <= q_pos[:, None])[None, None]  # [1, 1, new, ctx]
    dense = jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(q.reshape(s, new, qh, d), k, v, mask=mask, scale=d**-0.5).reshape(
            s * new, qh, d
        )
    )
    assert_close(out, dense(q, k, v), dtype)
    t_ours = bench(ours, q, kv_pages, lens, tables, cu, n, iters=iters)
    model_us, desc = _model(q, kv_pages, lens, tables, cu, n)
    rows.append(
        (
            f"chunked prefill {s}x{new} new on ctx{ctx} page{page}",
            t_ours,
            None,
            model_us,
            desc,
            {"dense (jax.nn.dot_product_attention)": bench(dense, q, k, v, iters=iters)},
        )
    )
    return rows


def print_table(rows) -> None:
    print(f"\n{'case':58s} {'us':>9s} {'% bw':>6s} {'model us':>9s} {'/model':>7s}  peer: us (ours / peer)")
    for name, us, frac, model_us, desc, peers in rows:
        pct = f"{100 * frac:5.1f}%" if frac is not None else "   n/a"
        print(f"{name:58s} {us:9.1f} {pct} {model_us:9.1f} {us / model_us:6.2f}x")
        print(f"{'':58s} plan: {desc}")
        for peer, peer_us in peers.items():
            print(f"{'':58s} {'':9s} {'':6s}  {peer}: {peer_us:.1f} ({us / peer_us:.2f}x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpret", action="store_true", help="correctness only, in the Pallas interpreter")
    parser.add_argument(
        "--smoke-timing",
        action="store_true",
        help="with --interpret: also run the timing code on tiny shapes (numbers meaningless)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    print(f"jax {jax.__version__}, devices: {jax.devices()}")
    if not args.interpret and jax.default_backend() != "gpu":
        print("no GPU here: run with --interpret for the correctness half")
        return 2
    t0 = time.perf_counter()
    failures = correctness(args.interpret)
    print(f"correctness: {failures} failure(s) ({time.perf_counter() - t0:.0f}s)")
    if args.interpret:
        if args.smoke_timing:
            print_table(timing(1e9, smoke=True))
        return 1 if failures else 0
    bw = copy_bandwidth()
    print(f"measured copy bandwidth: {bw / 1e12:.2f} TB/s")
    print_table(timing(bw))
    print(f"total {time.perf_counter() - t0:.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
