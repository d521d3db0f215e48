"""Ragged paged attention for NVIDIA GPUs (Pallas, Triton lowering): decode, chunked prefill, prefill.

Layout and masking conventions: :mod:`pallas_kernels.common` (``kv_pages: [pages, kv_heads, page_size,
2 * head_dim]``, K in the first half of a row, V in the second).

**Work list.** A work item is ``(sequence, q-block)``: up to ``q_block`` consecutive query tokens of *one*
sequence, so no program ever computes rows of two sequences. The wrapper builds the list on device from
``cu_q_lens`` (:func:`work_list`, a few tiny XLA ops); the grid has a static bound on the number of items
(``min(S, T) + (T - min(S, T)) // q_block`` for ``T`` tokens and ``S`` sequence slots) and programs past the
real items exit at once. A program owns one item x one KV head x one KV split: its rows are the item's tokens
times the KV head's ``group`` query heads (GQA rows packed, the group padded to a power of two), a
``[q_block * group_p, head_dim]`` tile of at least 16 rows (the MMA minimum). A decode item is one token of one
sequence: the ``group`` query heads sharing a KV head, padded to 16 rows, read every page of that KV head once.

**Ranges.** Decode buckets (``T <= 2 S``) are one launch with the decode tiling. Prefill and mixed buckets are
two launches: a *prefill* range over the sequences with more than a decode tile's tokens (64-128-row tiles: a
512-token chunk at group 4 is 16 q-blocks, each streaming the chunk's KV, which the wave model counts once from
HBM and 16 times from L2) and a *decode* range over the rest (one 16-row item per sequence, split-KV); the
second aliases the first's output. Q and the output are read and written in place
(``[T, q_heads, head_dim]``, masked row loads/stores), with no transposes around the kernel.

**Split-KV (flash-decoding).** When items x KV heads is below about twice the SM count (132 on H200), each
item's KV range is cut into contiguous chunks of KV blocks, one program each. The grid's split axis is sized
statically for the fewest items the bucket is likely to hold (see :func:`plan_gpu`); the number of splits in use
is computed on device from the real item count (:func:`effective_splits`), and programs without work (unused
splits, splits past a short item's KV, items past the real ones) stop after their scalar loads. Programs with
work write unnormalised partials ``(m, l, acc)`` for their real rows only; a second small Triton kernel
(grid ``(items, KV heads)``) reads the splits that walked KV (always a prefix, :func:`item_splits_with_work`),
combines them exactly with ``2^(m_k - max m)`` weights and stores the rows at the item's tokens.

**KV loop.** A KV step is ``pages_per_block`` pages gathered with one indexed load (``k_ref[pages]``). The
table entries of the *next* step are loaded one step ahead (carried through the loop), so the gather of step
``b + 1`` never waits on its own block-table load and Triton can pipeline it over ``num_stages`` (``cp.async``
into shared memory on sm_90). Table indices outside the item's page range (past its last visible key, or
before a sliding window) are clamped to the range, so such slots re-read a page already in L1/L2 instead of
fetching a new one from HBM. The item's KV blocks are walked in up to three loops: the *interior* blocks, whose
every key is visible to every row (at or before the item's first query, inside the last row's window), with no
mask at all, so K and V go from the asynchronous copy straight into the MMAs; and the *boundary* blocks before
and after them, where the causal, window and length masks apply and V slots outside the item's keys are zeroed
(a select between load and dot, which costs a shared-memory round trip, so only there) so stale or NaN slots
cannot leak. Online softmax in float32 with a finite mask value, in base 2: ``log2(e)`` is folded into the
logits' scale and every exponential is one ``exp2`` (the combine's ``m`` are in the same units).
Both dots run on the tensor cores with float32 accumulation; float32 operands as three TF32 products
(:func:`dot_precision`).

**Quantized pages** (int8, fp8_e4m3; :mod:`pallas_kernels.kv_quant`): a program also gathers its KV head's
K and V scale rows of the step's pages (``[pages_per_block, page_size]`` each, beside the values), casts the
values to the query dtype (exact) and applies the per-key scales to the logits (K) and to the probabilities
(V): ``rows x keys`` multiplications, not ``keys x head_dim``, and HBM reads only the quantized bytes and scales.

**Plan, tuning table and work model** (:mod:`pallas_kernels.gpu.plan`, :mod:`pallas_kernels.gpu.tuned_block_sizes`,
:mod:`pallas_kernels.gpu.work_model`). :func:`plan_gpu` (static shapes) picks the tiling from the table keyed by
head_dim, page
size and dtype and is what this wrapper runs; :func:`gpu_work` runs the same plan, work list and per-program KV
ranges in numpy for host-known lengths and returns :class:`pallas_kernels.work_model.KernelWork`. The pallas_call
gets a ``pl.CostEstimate`` from the plan at its static worst case (every slot full, every table full).
``count=True`` makes the kernel also return
its per-program KV steps and pages, which the tests compare with :func:`program_counts`.

**Why Triton and not Mosaic GPU.** In jax 0.11.2 the Triton lowering is the mature path for a page gather:
programs load through computed pointers, so "the pages named by this block-table row" is one indexed load that
Triton software-pipelines, on every CUDA GPU JAX supports. jax 0.11.2 already warns that Pallas-Triton is
deprecated; we pin jax. A Mosaic GPU port would need: (1) one TMA copy per page (a page of one KV head is a
contiguous ``[page_size, 2 * head_dim]`` tile in this layout, TMA-friendly) issued by a producer warp into a
ring of shared-memory slots with ``plgpu.barrier`` arrive/wait per slot, the block-table row read from SMEM
(copied in first) to form the TMA coordinates; (2) wgmma tiles have 64-row M per warpgroup, which would waste
16x on a 4-row decode group: swap the operands so keys and head_dim are the M side and the group's rows the N
side (N >= 8): ``S^T = K Q^T``, ``O^T = V^T P^T``; (3) warp specialisation
(producer / two consumer warpgroups) and the split-KV combine as a second small kernel or a cluster reduction;
(4) Hopper or newer (sm_90a) only, so the Triton kernel stays for Ampere/Ada; (5) the same plan/work list,
which is independent of the lowering."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import kv_quant
from pallas_kernels.common import MASK_VALUE, apply_soft_cap, validate_kernel_shape
from pallas_kernels.gpu import offsets as gpu_offsets
from pallas_kernels.gpu.plan import (
    GpuPlan,
    GpuRange,
    combine_num_warps,
    effective_splits,
    item_kv_range,
    item_splits_with_work,
    plan_gpu,
    range_work_list,
)
from pallas_kernels.gpu.work_model import gpu_work

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)

gpu_offsets.install()  # int8/fp8 page arrays of 2-4 GiB need 64-bit offsets (jax 0.11.2 decides by bytes)


def dot_precision(compute_dtype, interpret: bool):
    """The kernel's two dots: 16-bit operands exactly (tensor cores, float32 accumulate); float32 operands as
    three TF32 products (``a_hi b_hi + a_hi b_lo + a_lo b_hi``, each operand split into two TF32 halves: 22 of
    float32's 24 significand bits, a relative error per product near 2^-21) on the tensor cores, since Triton's
    exact-f32 dot is an FMA loop whose operand layouts spill at every tile the MMA minimum allows. The Pallas
    interpreter (XLA on CPU, which has no TF32) computes the float32 dots exactly."""
    if jnp.dtype(compute_dtype) == jnp.float32 and not interpret:
        return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return jax.lax.Precision.HIGHEST


def _kernel(
    # Work list (global memory, read as scalars), [num_items] int32 each.
    seq_ref,
    tok0_ref,
    n_ref,
    pos0_ref,
    splits_ref,  # [1] int32: splits in use (<= the grid's)
    tables_ref,  # [max_seqs, max_blocks] int32
    q_ref,  # [num_tokens, num_q_heads, head_dim], whole
    k_ref,  # [num_pages, page_size, head_dim]: K of this program's KV head
    v_ref,  # [num_pages, page_size, head_dim]: V of this program's KV head
    *refs,  # quantized: (k_scale, v_scale) [num_pages, page_size] f32 of this KV head; then (out_in, o) when
    # the range has one split, else (acc, m, l); then stats when counting
    plan: GpuPlan,
    rng: GpuRange,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    count: bool,
    quantized: bool,
    interpret: bool,
):
    qb, gp, group, d, ppb, page = (
        rng.q_block,
        plan.group_p,
        plan.group,
        plan.head_dim,
        rng.pages_per_block,
        plan.page_size,
    )
    rows, kv_block = rng.rows, rng.kv_block
    split, item, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s, tok0, n, pos0 = seq_ref[item], tok0_ref[item], n_ref[item], pos0_ref[item]
    b_lo, b_hi, p_lo, p_hi = item_kv_range(
        jnp,
        pos0,
        n,
        split=split,
        num_splits=splits_ref[0],
        kv_block=kv_block,
        page_size=page,
        max_blocks=plan.max_blocks,
        sliding_window=sliding_window,
    )
    if count:
        refs, stats_ref = refs[:-1], refs[-1]
        stats_ref[...] = jnp.zeros((2,), jnp.int32)
    if quantized:
        (ks_ref, vs_ref), refs = refs[:2], refs[2:]

    # Programs without work (items past the real ones, splits past K_eff or past a short item's KV) stop after
    # the scalar loads above: no q load, no table load, no store (the combine skips their partials).
    @pl.when(b_hi > b_lo)
    def _():
        j3 = jax.lax.broadcasted_iota(jnp.int32, (qb, gp, 1), 0)
        g3 = jax.lax.broadcasted_iota(jnp.int32, (qb, gp, 1), 1)
        row_ok3 = jnp.broadcast_to((j3 < n) & (g3 < group), (qb, gp, d))
        q_view = q_ref.at[pl.ds(tok0, qb), pl.ds(h * group, gp)]
        cdt = q_ref.dtype if quantized else k_ref.dtype  # quantized values are cast exactly to q's dtype
        precision = dot_precision(cdt, interpret)
        q = pltriton.load(q_view, mask=row_ok3, other=0).reshape(rows, d).astype(cdt)
        r = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        q_pos = pos0 + r // gp  # [rows, 1]
        row_real = r // gp < n
        page_iota = jax.lax.broadcasted_iota(jnp.int32, (ppb,), 0)

        def table_entries(b):  # the pages of KV step b, out-of-range slots clamped onto the item's pages
            return tables_ref[s, jnp.clip(b * ppb + page_iota, p_lo, p_hi)]

        first_key, last_key = p_lo * page, pos0 + n - 1  # the item's keys: [first_key, last_key]
        # Interior KV blocks: every key visible to every real row (at or before the first query, inside every
        # row's window), so they need no mask at all; only the blocks at the two ends are masked.
        int_hi = jnp.clip((pos0 + 1) // kv_block, b_lo, b_hi)  # blocks ending at or before the first query
        int_lo = b_lo
        if sliding_window is not None:  # the last row's window starts at last_key - sliding_window + 1
            int_lo = jnp.clip((last_key - sliding_window + kv_block) // kv_block, b_lo, int_hi)

        def kv_step(b, carry, masked: bool):
            m, den, acc, pages, stats = carry
            next_pages = table_entries(b + 1)  # one step ahead: the next gather's addresses are ready
            k = k_ref[pages].reshape(kv_block, d).astype(cdt)
            v = v_ref[pages].reshape(kv_block, d).astype(cdt)
            if masked:  # stale or NaN slots outside the item's keys must not reach p @ v (0 * NaN)
                v_pos = b * kv_block + jax.lax.broadcasted_iota(jnp.int32, (kv_block, 1), 0)
                v = jnp.where((v_pos >= first_key) & (v_pos <= last_key), v, jnp.zeros_like(v))
            k_pos = b * kv_block + jax.lax.broadcasted_iota(jnp.int32, (1, kv_block), 1)
            logits = pltriton.dot(q, k, trans_b=True, precision=precision)  # float32 accumulate
            if quantized:  # per-key scales; zero outside the item's keys (stale slots may hold NaN scales)
                k_scale, v_scale = ks_ref[pages].reshape(1, kv_block), vs_ref[pages].reshape(1, kv_block)
                if masked:
                    in_range = (k_pos >= first_key) & (k_pos <= last_key)
                    k_scale = jnp.where(in_range, k_scale, 0.0)
                    v_scale = jnp.where(in_range, v_scale, 0.0)
                logits = logits * k_scale
            # Base-2 softmax: log2(e) folded into the logits' scale, so every exponential is one exp2.
            if soft_cap is None:
                logits = logits * (sm_scale * LOG2E)
            else:
                logits = apply_soft_cap(logits * sm_scale, soft_cap) * LOG2E
            if masked:
                mask = row_real & (k_pos <= q_pos)
                if sliding_window is not None:
                    mask &= k_pos > q_pos - sliding_window
                logits = jnp.where(mask, logits, MASK_VALUE)
            m_next = jnp.maximum(m, jnp.max(logits, axis=1))
            alpha = jnp.exp2(m - m_next)
            p = jnp.exp2(logits - m_next[:, None])
            if masked:
                p = jnp.where(mask, p, 0.0)
            pv = p * v_scale if quantized else p
            acc = alpha[:, None] * acc + pltriton.dot(pv.astype(v.dtype), v, precision=precision)
            if count:  # KV steps, and distinct in-range pages gathered (the clamped slots re-read one of them)
                first, last = jnp.maximum(b * ppb, p_lo), jnp.minimum(b * ppb + ppb - 1, p_hi)
                stats = stats + jnp.where(jnp.arange(2) == 0, 1, jnp.maximum(last - first + 1, 0))
            return m_next, alpha * den + jnp.sum(p, axis=1), acc, next_pages, stats

        masked_step = functools.partial(kv_step, masked=True)
        carry = (
            jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, d), jnp.float32),
            table_entries(b_lo),
            jnp.zeros((2,), jnp.int32) if count else None,
        )
        if sliding_window is not None:
            carry = jax.lax.fori_loop(b_lo, int_lo, masked_step, carry)
        carry = jax.lax.fori_loop(int_lo, int_hi, functools.partial(kv_step, masked=False), carry)
        m, den, acc, _, stats = jax.lax.fori_loop(int_hi, b_hi, masked_step, carry)
        if count:
            stats_ref[...] = stats
        if rng.num_splits == 1:
            _, o_ref = refs
            out = jnp.where(den[:, None] > 0, acc / jnp.where(den > 0, den, 1.0)[:, None], 0.0)
            out = out.reshape(qb, gp, d).astype(o_ref.dtype)
            pltriton.store(o_ref.at[pl.ds(tok0, qb), pl.ds(h * group, gp)], out, mask=row_ok3)
        else:  # only the real rows (the combine reads only those)
            acc_ref, m_ref, l_ref = refs
            real = (r // gp < n) & (r % gp < group)  # [rows, 1]
            pltriton.store(acc_ref, acc, mask=jnp.broadcast_to(real, (rows, d)))
            pltriton.store(m_ref, m, mask=real[:, 0])
            pltriton.store(l_ref, den, mask=real[:, 0])


def _combine_kernel(
    tok0_ref,  # [num_items] int32
    n_ref,
    pos0_ref,
    splits_ref,  # [1] int32
    acc_ref,  # [K, I, H, rows, D] float32, whole
    m_ref,  # [K, I, H, rows]
    l_ref,
    _out_in,  # aliased to o_ref
    o_ref,  # [num_tokens, num_q_heads, head_dim]
    *,
    plan: GpuPlan,
    rng: GpuRange,
    sliding_window: int | None,
):
    """Flash-decoding reduction of one (item, KV head): ``2^(m_k - max m)``-weighted sum (base-2 maxima) over the
    splits that walked KV (a prefix), read and written for the real rows only, stored at the item's tokens."""
    qb, gp, group, d, rows = rng.q_block, plan.group_p, plan.group, plan.head_dim, rng.rows
    item, h = pl.program_id(0), pl.program_id(1)
    tok0, n, pos0 = tok0_ref[item], n_ref[item], pos0_ref[item]
    k_work = item_splits_with_work(
        jnp, pos0, n, num_splits=splits_ref[0], kv_block=rng.kv_block, sliding_window=sliding_window
    )

    @pl.when(k_work > 0)
    def _():
        r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
        real = (r // gp < n) & (r % gp < group)
        real2 = jnp.broadcast_to(real[:, None], (rows, d))

        def body(k, carry):
            m_run, l_run, acc_run = carry
            m_k = pltriton.load(m_ref.at[k, item, h], mask=real, other=MASK_VALUE)
            l_k = pltriton.load(l_ref.at[k, item, h], mask=real, other=0.0)
            acc_k = pltriton.load(acc_ref.at[k, item, h], mask=real2, other=0.0)
            m_new = jnp.maximum(m_run, m_k)
            a, b = jnp.exp2(m_run - m_new), jnp.exp2(m_k - m_new)  # m in base-2 units
            return m_new, a * l_run + b * l_k, a[:, None] * acc_run + b[:, None] * acc_k

        init = (
            jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, d), jnp.float32),
        )
        _, den, acc = jax.lax.fori_loop(0, k_work, body, init)
        out = jnp.where(den[:, None] > 0, acc / jnp.where(den > 0, den, 1.0)[:, None], 0.0)
        out = out.reshape(qb, gp, d).astype(o_ref.dtype)
        j3 = jax.lax.broadcasted_iota(jnp.int32, (qb, gp, 1), 0)
        g3 = jax.lax.broadcasted_iota(jnp.int32, (qb, gp, 1), 1)
        ok = jnp.broadcast_to((j3 < n) & (g3 < group), (qb, gp, d))
        pltriton.store(o_ref.at[pl.ds(tok0, qb), pl.ds(h * group, gp)], out, mask=ok)


def _static_cost(plan: GpuPlan, rng: GpuRange, sliding_window: int | None) -> pl.CostEstimate:
    """Cost estimate of one launch at the bucket's worst case (the only case known at trace time): as many of the
    range's sequences as the bucket holds sharing the tokens evenly (a decode range: ``min(S, T)`` one-token
    sequences), each with a full block table of keys."""
    if rng.name == "decode":
        n_seqs = min(plan.max_seqs, plan.num_tokens)
        q_lens = np.ones(n_seqs, np.int64)
    else:
        n_seqs = max(1, min(plan.max_seqs, plan.num_tokens // (rng.min_q_len + 1)))
        q_lens = np.full(n_seqs, plan.num_tokens // n_seqs)
        q_lens[0] += plan.num_tokens - q_lens.sum()
    kv_lens = np.maximum(plan.max_blocks * plan.page_size, q_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    one = dataclasses.replace(plan, ranges=(rng,))
    work = gpu_work(one, kv_lens, cu, n_seqs, sliding_window)
    return pl.CostEstimate(flops=work.issued_flops, transcendentals=work.exps, bytes_accessed=work.hbm_bytes)


def _combine_cost(plan: GpuPlan, rng: GpuRange) -> pl.CostEstimate:
    """The combine at its static worst case: every split of every item with work, every row real."""
    rows = rng.num_splits * rng.num_items * plan.num_kv_heads * rng.rows
    return pl.CostEstimate(
        flops=3 * rows * plan.head_dim,
        transcendentals=2 * rows,
        bytes_accessed=rows * (plan.head_dim + 2) * 4
        + plan.num_tokens * plan.num_q_heads * plan.head_dim * plan.q_itemsize,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "interpret",
        "q_block",
        "pages_per_block",
        "num_splits",
        "num_warps",
        "num_stages",
        "decode_q_block",
        "decode_num_splits",
        "one_range",
        "count",
    ),
)
def ragged_paged_attention_gpu(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    kv_pages,  # [num_pages, num_kv_heads, page_size, 2 * head_dim], or kv_quant.QuantizedPages
    kv_lens: jax.Array,  # [max_seqs] int32
    block_tables: jax.Array,  # [max_seqs, max_blocks_per_seq] int32
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    kv_scales: jax.Array | None = None,  # [num_pages, 2 * num_kv_heads * page_size] f32, quantized pages
    interpret: bool = False,
    q_block: int | None = None,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    decode_q_block: int | None = None,
    decode_num_splits: int | None = None,
    one_range: bool = False,
    count: bool = False,
):
    """Ragged paged attention on GPU; returns ``[num_tokens, num_q_heads, head_dim]`` in ``q.dtype``.

    Tiling comes from :func:`plan_gpu`; the keyword overrides (see there) are for tests and tuning.
    ``interpret=True`` runs the kernel in the Pallas interpreter (CPU is fine). ``count=True`` (tests) also
    returns, per range, per-program ``[num_splits, num_items, num_kv_heads, 2]`` int32 counters: KV steps walked,
    distinct pages gathered. Quantized pages: ``kv_pages`` as ``QuantizedPages`` or with ``kv_scales``.
    """
    if kv_scales is None:
        kv_pages, kv_scales = kv_quant.split(kv_pages)
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = kv_pages.shape
    max_seqs, max_blocks = block_tables.shape
    validate_kernel_shape(head_dim, page_size)
    plan = plan_gpu(
        num_tokens,
        max_seqs,
        max_blocks,
        num_q_heads,
        num_kv_heads,
        head_dim,
        page_size,
        kv_pages.dtype,
        q.dtype,
        q_block=q_block,
        pages_per_block=pages_per_block,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        decode_q_block=decode_q_block,
        decode_num_splits=decode_num_splits,
        one_range=one_range,
    )
    out = jnp.zeros(q.shape, q.dtype)  # padding tokens' rows stay zero; every real row is written once
    stats = []
    for rng in plan.ranges:
        out, st = _launch(
            plan,
            rng,
            out,
            q,
            kv_pages,
            kv_scales,
            kv_lens,
            block_tables,
            cu_q_lens,
            num_seqs,
            sm_scale=sm_scale,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
            interpret=interpret,
            count=count,
        )
        stats.append(st)
    return (out, tuple(stats)) if count else out


def _launch(
    plan: GpuPlan,
    rng: GpuRange,
    out,
    q,
    kv_pages,
    kv_scales,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale,
    soft_cap,
    sliding_window,
    interpret,
    count,
):
    """One range: its work list, its pallas_call, and (split ranges) the combine into ``out``."""
    seq, tok0, n, pos0, _ = range_work_list(jnp, rng, cu_q_lens, kv_lens, num_seqs[0])
    splits = jnp.full((1,), rng.num_splits, jnp.int32)
    if rng.adaptive_splits:
        real_items = jnp.sum(n > 0).astype(jnp.int32)
        splits = effective_splits(jnp, real_items, num_splits=rng.num_splits, num_kv_heads=plan.num_kv_heads)
        splits = splits[None]
    nsp, ni, nh, rows, d = rng.num_splits, rng.num_items, plan.num_kv_heads, rng.rows, plan.head_dim
    full = lambda x: pl.BlockSpec(x.shape, lambda k, i, h: (0,) * x.ndim)
    kv_spec = lambda half: pl.BlockSpec((kv_pages.shape[0], None, plan.page_size, d), lambda k, i, h: (0, h, 0, half))
    meta = (seq, tok0, n, pos0, splits, block_tables)
    in_specs = [full(x) for x in meta] + [full(q), kv_spec(0), kv_spec(1)]
    args = [*meta, q, kv_pages, kv_pages]
    quantized = kv_scales is not None
    if quantized:  # [P, >= 2 * H, page_size]: row 2 h is K's scales of head h, row 2 h + 1 V's (then any padding)
        sc = kv_scales.reshape(kv_pages.shape[0], kv_scales.shape[1] // plan.page_size, plan.page_size)
        for half in (0, 1):
            in_specs.append(
                pl.BlockSpec((sc.shape[0], None, plan.page_size), lambda k, i, h, half=half: (0, 2 * h + half, 0))
            )
            args.append(sc)
    aliases = {}
    if nsp == 1:  # rows straight into the output (aliased: other ranges' rows are kept)
        in_specs.append(full(out))
        aliases = {len(args): 0}
        args.append(out)
        out_specs = [full(out)]
        out_shape = [jax.ShapeDtypeStruct(out.shape, out.dtype)]
    else:
        out_specs = [
            pl.BlockSpec((None, None, None, rows, d), lambda k, i, h: (k, i, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda k, i, h: (k, i, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda k, i, h: (k, i, h, 0)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((nsp, ni, nh, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((nsp, ni, nh, rows), jnp.float32),
            jax.ShapeDtypeStruct((nsp, ni, nh, rows), jnp.float32),
        ]
    if count:
        out_specs.append(pl.BlockSpec((None, None, None, 2), lambda k, i, h: (k, i, h, 0)))
        out_shape.append(jax.ShapeDtypeStruct((nsp, ni, nh, 2), jnp.int32))
    kernel = functools.partial(
        _kernel,
        plan=plan,
        rng=rng,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        count=count,
        quantized=quantized,
        interpret=interpret,
    )
    outs = pl.pallas_call(
        kernel,
        grid=rng.grid(nh),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=rng.num_warps, num_stages=rng.num_stages),
        cost_estimate=_static_cost(plan, rng, sliding_window),
        interpret=interpret,
        name=f"ragged_paged_attention_gpu_{rng.name}",
    )(*args)
    if nsp == 1:
        out = outs[0]
    else:
        item_meta = (tok0, n, pos0, splits)
        full2 = lambda x: pl.BlockSpec(x.shape, lambda i, h: (0,) * x.ndim)
        out = pl.pallas_call(
            functools.partial(_combine_kernel, plan=plan, rng=rng, sliding_window=sliding_window),
            grid=(ni, nh),
            in_specs=[full2(x) for x in (*item_meta, *outs[:3], out)],
            out_specs=full2(out),
            out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
            input_output_aliases={7: 0},
            compiler_params=pltriton.CompilerParams(num_warps=combine_num_warps(rng, plan.head_dim), num_stages=2),
            cost_estimate=_combine_cost(plan, rng),
            interpret=interpret,
            name=f"ragged_paged_attention_gpu_{rng.name}_combine",
        )(*item_meta, *outs[:3], out)
    return out, (outs[-1] if count else None)
