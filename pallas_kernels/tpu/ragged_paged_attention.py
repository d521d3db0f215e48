"""Ragged paged attention for TPU (Pallas/Mosaic): decode, chunked prefill and prefill.

Layout and masking conventions: :mod:`pallas_kernels.common`. Work division: :mod:`pallas_kernels.tpu.plan`.

Two ranges, two ``pallas_call``s of this one kernel with different static block sizes: decode items (one
sequence, its single query token, the ``group`` query heads of each KV head as a ``[group, head_dim]`` matrix)
and prefill items (``tokens_per_item`` consecutive query tokens of one sequence, the ``group`` heads stacked
as ``[group * tokens, head_dim]``). An item never holds rows of two sequences, so every row it computes is
used (up to the MXU's 8-row tile and the unused tail of a sequence's last item). The prefill call writes into
the decode call's output (aliased), so the two ranges cost no merge pass.

Data movement (all manual DMAs; q and the output are ``memory_space=ANY``, the pages and scales pinned to HBM
whatever their size, :func:`_in_hbm`):
- A KV block is ``pages_per_block`` pages. One page of one layer is one contiguous ``[num_kv_heads,
  page_size, 2 * head_dim]`` slab, so a block is ``pages_per_block`` DMAs into a double buffer, all signalling
  one semaphore; pages past ``kv_len`` are not copied, blocks before a sliding window or after the item's last
  query position are skipped.
- Prefetch runs across grid steps: while an item computes its last block, the next item's first KV block and
  its queries are already in flight into the other buffer slot (the grid is therefore sequential,
  ``arbitrary``; v5e and v6e have one TensorCore per chip, so nothing is lost). Only the very first block of
  a call is exposed.
- Queries of an item are read with one DMA per set bit of its token count (a static-size copy per power of
  two, so a short last item never reads or writes past its own rows), and its output leaves the same way;
  the output DMA of item ``i`` is waited at the end of item ``i + 1``, overlapping its compute.

Compute: for each KV head, K and V are the lane-aligned halves ``[:, :head_dim]`` and ``[:, head_dim:]`` of the
buffer rows (no strided loads). An online softmax in float32 scratch (``m``, ``l`` lane-replicated, ``acc``)
folds in each block. Only a block that some row sees in part (the causal diagonal, ``kv_len``, the window's
edge) is masked: there the mask value is finite, probabilities of masked keys are exactly zero, and V rows
past ``kv_len`` are zeroed (a poisoned slot may hold NaN), so an item's rows never see stale memory; every
other block is computed without masks (the same values: every mask there is true).

Quantized pages (int8, fp8_e4m3; :mod:`pallas_kernels.kv_quant`): each page's scale row
(``[2 * num_kv_heads * page_size]`` float32, one scale per token, head and K/V, padded to whole lanes in the
engine's TPU caches; padding columns are masked out) is DMA'd with the page into a
``[pages_per_block, 2 * num_kv_heads * page_size]`` buffer on the same semaphore. Once per block the rows are
broadcast to the block's key rows (``[kv_block, 2 * num_kv_heads * page_size]``), the diagonal ``lane %
page_size == key % page_size`` kept, and a small MXU product with a 0/1 head selector (``sel . diag^T``, the
q.k^T form) turns them into one ``[1, kv_block]`` lane row per (head, K/V): the orientation of the logits' key
axis. Each output of that product sums one nonzero, so it is computed exactly as three one-pass bf16 products
of the scales' bf16 parts (:func:`bf16_parts`), half the MXU passes of an f32 ``HIGHEST`` product. The values
are cast exactly to the query dtype; the K scales multiply the logits and the V scales the probabilities
(``rows x keys`` multiplications per head, 8 rows in decode, instead of ``keys x head_dim`` to dequantize K and
V). HBM carries only the quantized values and the scales.

``stats`` (an SMEM output, ``[3 * num_items]``): pages DMA'd, blocks computed and blocks computed with masks
per item, counted where the kernel issues them; the work model's tests compare it with
:func:`pallas_kernels.tpu.plan.item_counts`.
Block tables live in SMEM, which bounds ``max_seqs * max_blocks_per_seq`` (as in JAX's own kernel).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import kv_quant
from pallas_kernels.common import MASK_VALUE, apply_soft_cap, kv_dims, validate_kernel_shape
from pallas_kernels.tpu import limits as tpu_limits
from pallas_kernels.tpu.plan import (
    RangePlan,
    TpuPlan,
    item_blocks,
    masked_block,
    plan_items,
    plan_tpu,
    static_work,
    vmem_bytes,
)
from pallas_kernels.tpu.tuned_block_sizes import get_block_sizes, tpu_generation

_LANES = 128


def _kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref,  # [max_seqs] int32
    tables_ref,  # [max_seqs * max_blocks] int32, flattened block table
    cu_q_lens_ref,  # [max_seqs + 1] int32
    item_seq_ref,  # [num_items] int32
    item_t0_ref,  # [num_items] int32, first flat query token of the item
    item_n_ref,  # [num_items] int32, query tokens of the item (0: padding item, all after the real ones)
    # Inputs (HBM).
    q_hbm,  # [num_tokens, num_q_heads, head_dim]
    kv_hbm,  # [num_pages, num_kv_heads, page_size, 2 * head_dim]
    sc_hbm,  # [num_pages, >= 2 * num_kv_heads * page_size] f32 scales (kv_quant); [1, 128] placeholder for float pages
    out_in,  # [num_tokens, num_q_heads, head_dim], aliased to out_hbm
    # Outputs.
    out_hbm,  # [num_tokens, num_q_heads, head_dim]
    stats_ref,  # [3 * num_items] int32 (SMEM): pages DMA'd, blocks computed, blocks computed with masks
    # Scratch.
    q_buf,  # [2, w, num_q_heads, head_dim]
    o_buf,  # [2, w, num_q_heads, head_dim]
    kv_buf,  # [2, num_kv_heads, pages_per_block * page_size, 2 * head_dim]
    sc_buf,  # [2, pages_per_block, 2 * num_kv_heads * page_size] f32 (quantized pages; else a placeholder)
    m_ref,  # [num_kv_heads, group * w, 128] f32, running max (lane-replicated)
    l_ref,  # [num_kv_heads, group * w, 128] f32, running denominator
    acc_ref,  # [num_kv_heads, group * w, head_dim] f32
    kv_sem,  # DMA [2]
    q_sem,  # DMA [2]
    o_sem,  # DMA [2]
    slot_ref,  # SMEM [1] int32: KV buffer slot that holds the current item's first block
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_block: int,
    max_blocks: int,
    quantized: bool,
):
    del out_in  # same buffer as out_hbm
    w, num_q_heads, head_dim = q_buf.shape[1:]
    num_kv_heads, kv_block = kv_buf.shape[1], kv_buf.shape[2]
    page_size = kv_hbm.shape[2]
    group = num_q_heads // num_kv_heads
    rows = group * w
    num_items = item_n_ref.shape[0]
    i = pl.program_id(0)

    def info(j):
        """Item ``j``: its sequence, first token, token count, kv_len, first query position, KV blocks."""
        j = jnp.minimum(j, num_items - 1)
        s, t0, n = item_seq_ref[j], item_t0_ref[j], item_n_ref[j]
        q_start = cu_q_lens_ref[s]
        q_len, kv_len = cu_q_lens_ref[s + 1] - q_start, kv_lens_ref[s]
        first_pos, b_lo, b_hi = item_blocks(kv_len, q_len, q_start, t0, n, kv_block, sliding_window)
        return s, t0, n, kv_len, first_pos, b_lo, b_hi

    def token_copies(j, slot, hbm, buf, sems, to_hbm):
        """The item's rows as one static-size DMA per set bit of its token count ``n`` (``n <= w``)."""
        _, t0, n, *_ = info(j)
        copies = []
        for bit in range(w.bit_length()):
            size, off = 1 << bit, (n >> (bit + 1)) << (bit + 1)
            src, dst = hbm.at[pl.ds(t0 + off, size)], buf.at[slot, pl.ds(off, size)]
            if to_hbm:
                src, dst = dst, src
            copies.append(((n >> bit) & 1 == 1, pltpu.make_async_copy(src, dst, sems.at[slot])))
        return copies

    def kv_copies(j, b, slot):
        """Page DMAs of KV block ``b`` of item ``j`` into buffer ``slot`` (none past kv_len)."""
        s, _, _, kv_len, *_ = info(j)
        n_pages = (kv_len + page_size - 1) // page_size
        copies = []
        for p in range(pages_per_block):
            idx = b * pages_per_block + p
            page = tables_ref[s * max_blocks + jnp.minimum(idx, max_blocks - 1)]
            dst = kv_buf.at[slot, :, pl.ds(p * page_size, page_size), :]
            copies.append((idx < n_pages, pltpu.make_async_copy(kv_hbm.at[page], dst, kv_sem.at[slot])))
        return copies

    def scale_copies(j, b, slot):
        """The scale rows of the same pages (quantized pages only), on the same semaphore."""
        if not quantized:
            return []
        s, _, _, kv_len, *_ = info(j)
        n_pages = (kv_len + page_size - 1) // page_size
        copies = []
        for p in range(pages_per_block):
            idx = b * pages_per_block + p
            page = tables_ref[s * max_blocks + jnp.minimum(idx, max_blocks - 1)]
            copy = pltpu.make_async_copy(sc_hbm.at[pl.ds(page, 1)], sc_buf.at[slot, pl.ds(p, 1)], kv_sem.at[slot])
            copies.append((idx < n_pages, copy))
        return copies

    def start_one(copy, count_at):
        copy.start()
        if count_at is not None:
            stats_ref[count_at] += 1

    def start(copies, count_at=None):
        for needed, copy in copies:
            pl.when(needed)(functools.partial(start_one, copy, count_at))

    def wait(copies):
        for needed, copy in copies:
            pl.when(needed)(copy.wait)

    def start_item(j, kv_slot):
        """Queries and first KV block of item ``j`` (queries into slot ``j % 2``, KV into ``kv_slot``)."""
        _, _, _, _, _, b_lo, _ = info(j)
        start(token_copies(j, j % 2, q_hbm, q_buf, q_sem, False))
        start(kv_copies(j, b_lo, kv_slot), count_at=3 * j)
        start(scale_copies(j, b_lo, kv_slot))

    @pl.when(i == 0)
    def _():
        def zero(k, c):
            stats_ref[k] = 0
            return c

        jax.lax.fori_loop(0, 3 * num_items, zero, 0)
        slot_ref[0] = 0

        @pl.when(item_n_ref[0] > 0)
        def _():
            start_item(0, 0)

    s, t0, n, kv_len, first_pos, b_lo, b_hi = info(i)
    has_next = (i + 1 < num_items) & (item_n_ref[jnp.minimum(i + 1, num_items - 1)] > 0)
    q_slot = i % 2

    def load_q(h):
        """Rows of the query heads of KV head ``h``: ``[group * w, head_dim]``, row = g * w + token."""
        if w == 1:
            return q_buf[q_slot, 0, pl.ds(h * group, group), :]
        parts = [q_buf[q_slot, :, h * group + g, :] for g in range(group)]
        return parts[0] if group == 1 else jnp.concatenate(parts, axis=0)

    def compute(b, slot, masked: bool):
        if masked:
            tok = jax.lax.broadcasted_iota(jnp.int32, (rows, kv_block), 0) % w
            k_pos = b * kv_block + jax.lax.broadcasted_iota(jnp.int32, (rows, kv_block), 1)
            q_pos = first_pos + tok
            mask = (tok < n) & (k_pos <= q_pos)
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            v_ok = b * kv_block + jax.lax.broadcasted_iota(jnp.int32, (kv_block, head_dim), 0) < kv_len
        if quantized:  # per-key scales as rows: scales_t[2 h + kv] is [1, kv_block], kv_block along lanes
            width = sc_buf.shape[2]
            rows_sc = jnp.broadcast_to(sc_buf[slot][:, None, :], (pages_per_block, page_size, width))
            rows_sc = rows_sc.reshape(kv_block, width)  # key r: its page's scale row
            lane = jax.lax.broadcasted_iota(jnp.int32, (kv_block, width), 1)
            key = jax.lax.broadcasted_iota(jnp.int32, (kv_block, width), 0)
            own = lane % page_size == key % page_size  # key r: its own slot's scales
            if width > 2 * num_kv_heads * page_size:  # a lane-dense row's padding (kv_quant.scale_row_width)
                own &= lane < 2 * num_kv_heads * page_size
            diag = jnp.where(own, rows_sc, 0.0)
            hk_rows = max(8, 2 * num_kv_heads)
            sel = (
                jax.lax.broadcasted_iota(jnp.int32, (hk_rows, width), 1) // page_size
                == jax.lax.broadcasted_iota(jnp.int32, (hk_rows, width), 0)
            ).astype(jnp.bfloat16)
            # [hk_rows, kv_block] = sel . diag^T on the MXU (the q.k^T form): each output sums exactly one
            # nonzero, so three one-pass bf16 products of diag's exact bf16 parts, added in f32, give the f32
            # scales bit for bit (f32 HIGHEST takes six passes).
            hi, mid, lo = (
                jax.lax.dot_general(sel, part, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                for part in bf16_parts(diag)
            )
            scales_t = (hi + mid) + lo
            if masked:
                key_ok = b * kv_block + jax.lax.broadcasted_iota(jnp.int32, (1, kv_block), 1) < kv_len
                scales_t = jnp.where(key_ok, scales_t, 0.0)  # stale slots may hold NaN scales

        for h in range(num_kv_heads):
            k = kv_buf[slot, h, :, pl.ds(0, head_dim)]
            v = kv_buf[slot, h, :, pl.ds(head_dim, head_dim)]
            if quantized:  # int8 / e4m3 values are exact in q's dtype
                k, v = k.astype(q_buf.dtype), v.astype(q_buf.dtype)
            logits = jax.lax.dot_general(load_q(h), k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            if quantized:
                logits = logits * scales_t[2 * h : 2 * h + 1, :]
            logits = apply_soft_cap(logits * sm_scale, soft_cap)
            if masked:
                logits = jnp.where(mask, logits, MASK_VALUE)
            m_prev, l_prev = m_ref[h], l_ref[h]  # [rows, 128]
            m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.exp(logits - m_next[:, :1])
            if masked:
                p = jnp.where(mask, p, 0.0)
            l_ref[h] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            m_ref[h] = m_next
            if masked:
                v = jnp.where(v_ok, v, jnp.zeros_like(v))
            if quantized:
                p = p * scales_t[2 * h + 1 : 2 * h + 2, :]
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            acc_ref[h] = alpha[:, :1] * acc_ref[h] + pv

    @pl.when(n > 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        wait(token_copies(i, q_slot, q_hbm, q_buf, q_sem, False))

        def block(b, slot):
            last = b + 1 == b_hi

            @pl.when(~last)
            def _():
                start(kv_copies(i, b + 1, 1 - slot), count_at=3 * i)
                start(scale_copies(i, b + 1, 1 - slot))

            @pl.when(last & has_next)
            def _():
                start_item(i + 1, 1 - slot)

            wait(kv_copies(i, b, slot))
            wait(scale_copies(i, b, slot))
            stats_ref[3 * i + 1] += 1
            # A block every row sees whole needs no mask (rows past n compute on stale queries there, but rows
            # are independent and theirs are never written out).
            partial = masked_block(b, first_pos, n, kv_block, sliding_window)
            pl.when(~partial)(functools.partial(compute, b, slot, False))

            @pl.when(partial)
            def _():
                stats_ref[3 * i + 2] += 1
                compute(b, slot, True)

            return 1 - slot

        slot_ref[0] = jax.lax.fori_loop(b_lo, b_hi, block, slot_ref[0])

        # Output: the previous item's DMA (same slot two items ago is long done) must land before ours.
        @pl.when(i > 0)
        def _():
            wait(token_copies(i - 1, 1 - q_slot, out_hbm, o_buf, o_sem, True))

        den = l_ref[...][:, :, :1]
        out = jnp.where(den > 0, acc_ref[...] / jnp.where(den > 0, den, 1.0), 0.0).astype(o_buf.dtype)
        for h in range(num_kv_heads):
            if w == 1:
                o_buf[q_slot, 0, pl.ds(h * group, group), :] = out[h]
            else:
                for g in range(group):
                    o_buf[q_slot, :, h * group + g, :] = out[h, g * w : (g + 1) * w]
        start(token_copies(i, q_slot, out_hbm, o_buf, o_sem, True))

        @pl.when(~has_next)
        def _():
            wait(token_copies(i, q_slot, out_hbm, o_buf, o_sem, True))


def bf16_parts(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x`` (float32) as three bfloat16 arrays whose float32 sum ``(hi + mid) + lo`` is ``x`` exactly: each
    part rounds what the previous ones left (8 significant bits each; 24 in all), for every finite ``x`` whose
    last residual is not subnormal (``|x| >= 2**-110``: far below any KV scale)."""
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    return hi, mid, (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)


def _run_range(
    plan: TpuPlan,
    rng: RangePlan,
    items,
    meta,
    q,
    kv_pages,
    kv_scales,
    out,
    *,
    sm_scale,
    soft_cap,
    sliding_window,
    interpret,
    generation,
):
    """One ``pallas_call`` over the items of one range; writes their rows into ``out`` (aliased). Its VMEM
    and SMEM are checked against ``generation``'s (:mod:`pallas_kernels.tpu.limits`)."""
    kv_lens, tables, cu_q_lens = meta
    max_blocks = tables.shape[1]
    w, num_items = rng.tokens_per_item, rng.num_items
    tpu_limits.check_smem(tables.shape[0], max_blocks, num_items, generation)
    kv_block = rng.pages_per_block * plan.page_size
    rows = plan.group * w
    quantized = kv_scales is not None
    if not quantized:
        kv_scales = jnp.zeros((1, _LANES), jnp.float32)  # placeholder operand, never read
    sc_shape = (2, rng.pages_per_block, kv_scales.shape[1]) if quantized else (2, 1, _LANES)
    scratch = [
        pltpu.VMEM((2, w, plan.num_q_heads, plan.head_dim), q.dtype),
        pltpu.VMEM((2, w, plan.num_q_heads, plan.head_dim), q.dtype),
        pltpu.VMEM((2, plan.num_kv_heads, kv_block, 2 * plan.head_dim), kv_pages.dtype),
        pltpu.VMEM(sc_shape, jnp.float32),
        pltpu.VMEM((plan.num_kv_heads, rows, _LANES), jnp.float32),
        pltpu.VMEM((plan.num_kv_heads, rows, _LANES), jnp.float32),
        pltpu.VMEM((plan.num_kv_heads, rows, plan.head_dim), jnp.float32),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SMEM((1,), jnp.int32),
    ]
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        pages_per_block=rng.pages_per_block,
        max_blocks=max_blocks,
        quantized=quantized,
    )
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    vmem = vmem_bytes(plan, rng)
    bound = static_work(plan, rng, max_blocks, kv_pages.shape[0])
    # The grid is the range's real item count (at least one step), so padding items cost no grid step: a
    # decode-only batch runs one empty prefill step, not the prefill range's static bound.
    steps = jnp.maximum(jnp.sum(items.n > 0), 1).astype(jnp.int32)
    out, stats = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(steps,),
            in_specs=[any_spec, any_spec, any_spec, any_spec],
            out_specs=[any_spec, pl.BlockSpec(memory_space=pltpu.SMEM)],
            scratch_shapes=scratch,
        ),
        out_shape=[
            jax.ShapeDtypeStruct(out.shape, out.dtype),
            jax.ShapeDtypeStruct((3 * num_items,), jnp.int32),
        ],
        input_output_aliases={9: 0},  # out_in (after 6 scalar-prefetch operands, q, kv, scales) -> out
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=tpu_limits.vmem_limit(vmem, generation),
        ),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=bound.issued_flops, transcendentals=bound.exps, bytes_accessed=bound.hbm_bytes
        ),
        name="ragged_paged_attention_tpu_" + ("decode" if w == 1 else "prefill"),
    )(kv_lens, tables.reshape(-1), cu_q_lens, *items, q, *_in_hbm(kv_pages, kv_scales, interpret), out)
    return out, stats


def _in_hbm(kv_pages, kv_scales, interpret):
    """The page and scale operands constrained to HBM (``pltpu.with_memory_space_constraint``).

    Why: with ``memory_space=ANY`` alone, XLA's memory-space assignment may place a small cache in VMEM. At
    2,049 pages per layer (16 MiB, Qwen2.5-0.5B unrolled on v6e) it sliced every layer's whole page array into
    VMEM, ran the KV scatter and this kernel there, and copied the array back to HBM: two whole-cache copies
    per layer per step, where the kernel DMAs only the pages it reads. Pinned to HBM, the scatter writes in
    place and the kernel reads the pages where they are, at any cache size (the audit of
    ``scripts/checks/check_tpu_compile.py`` compiles small and full caches)."""
    if interpret:
        return kv_pages, kv_scales
    return tuple(pltpu.with_memory_space_constraint(x, pltpu.HBM) for x in (kv_pages, kv_scales))


def tpu_plan_for(
    q_shape,
    kv_pages_shape,
    max_seqs: int,
    max_blocks: int,
    dtype,
    generation: str | None = None,
    tokens_per_item: int | None = None,
    pages_per_block: int | None = None,
    q_dtype=None,
    scale_width: int = 0,
) -> TpuPlan:
    """The kernel's static plan for one call's shapes (what the wrapper below uses); quantized pages: the
    queries' ``q_dtype`` and the scale rows' ``scale_width`` (lanes), which the VMEM plan counts."""
    num_tokens, num_q_heads, head_dim = q_shape
    _, num_kv_heads, page_size, _ = kv_pages_shape
    return plan_tpu(
        num_tokens,
        max_seqs,
        num_q_heads,
        num_kv_heads,
        head_dim,
        page_size,
        jnp.dtype(dtype).itemsize,
        max_blocks,
        get_block_sizes(num_kv_heads, head_dim, dtype, generation),
        tokens_per_item,
        pages_per_block,
        jnp.dtype(q_dtype).itemsize if q_dtype is not None else 0,
        scale_width,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "interpret",
        "tokens_per_item",
        "pages_per_block",
        "generation",
        "return_stats",
    ),
)
def ragged_paged_attention_tpu(
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
    kv_scales: jax.Array | None = None,  # [num_pages, >= 2 * num_kv_heads * page_size] f32, quantized pages
    interpret: bool | pltpu.InterpretParams = False,
    tokens_per_item: int | None = None,
    pages_per_block: int | None = None,
    generation: str | None = None,
    return_stats: bool = False,
):
    """Ragged paged attention on TPU; returns ``[num_tokens, num_q_heads, head_dim]`` in ``q.dtype``.

    Block sizes come from :mod:`pallas_kernels.tpu.tuned_block_sizes` for ``generation`` (by default the local TPU's,
    else a
    heuristic); ``tokens_per_item`` and ``pages_per_block`` override them (tests). ``interpret``: True or a
    ``pltpu.InterpretParams`` runs the kernel in the TPU interpreter (CPU is fine). ``return_stats`` also
    returns ``(decode_stats, prefill_stats)``, each ``[num_items, 3]``: pages DMA'd, blocks computed and blocks
    computed with masks (the boundary blocks).
    Quantized pages: ``kv_pages`` as ``QuantizedPages`` or with ``kv_scales``; the queries stay in their dtype.
    """
    if kv_scales is None:
        kv_pages, kv_scales = kv_quant.split(kv_pages)
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = kv_dims(kv_pages)
    max_seqs, max_blocks = block_tables.shape
    validate_kernel_shape(head_dim, page_size)
    quantized = kv_scales is not None
    plan = tpu_plan_for(
        q.shape,
        kv_pages.shape,
        max_seqs,
        max_blocks,
        kv_pages.dtype,
        generation,
        tokens_per_item,
        pages_per_block,
        q_dtype=q.dtype if quantized else None,
        scale_width=0 if kv_scales is None else kv_scales.shape[1],
    )
    if interpret is True:
        interpret = pltpu.InterpretParams()
    out_dtype = q.dtype
    if kv_scales is None:
        q = q.astype(kv_pages.dtype)
    meta = (kv_lens, block_tables, cu_q_lens)
    if generation is None:
        generation = tpu_generation()
    opts: dict[str, Any] = dict(
        sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret
    )
    opts["generation"] = generation
    out = jnp.zeros(q.shape, q.dtype)  # padding rows stay zero; every real row is written by one item
    stats = []
    for rng, decode in ((plan.decode, True), (plan.prefill, False)):
        items = plan_items(jnp, cu_q_lens, num_seqs[0], rng, decode)
        out, st = _run_range(plan, rng, items, meta, q, kv_pages, kv_scales, out, **opts)
        stats.append(st.reshape(-1, 3))
    out = out.astype(out_dtype)
    return (out, tuple(stats)) if return_stats else out
