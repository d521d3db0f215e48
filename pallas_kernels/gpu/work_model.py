"""The GPU kernel's work model: what one call moves and issues, from the kernel's own plan, work lists and KV
ranges (:mod:`pallas_kernels.gpu.plan`), as :class:`pallas_kernels.work_model.KernelWork`.

**HBM model** (``kv_bytes_read``): programs are launched in grid order (split fastest, then item, then KV head)
and ``SMs x programs_per_sm`` of them are resident at once (a *wave*). Programs of one wave that read the same
page of one stream (sequence, KV head) share one HBM read through the L2 (50 MB on H200: a wave's streams
advance through their KV together); programs of different waves, or of different launches, do not.
:func:`gpu_work_detail` also reports the bytes gathered into the SMs (no reuse across programs at all) and the
minimum. :func:`program_counts` is what the kernel's ``count=True`` counters report, program by program.

:func:`legacy_gpu_work` re-derives the previous GPU design (programs over ``q_block`` flat tokens walking every
sequence with a token in the block, no split-KV) with the same wave model, for before/after tables."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import cdiv
from pallas_kernels.gpu.plan import (
    MMA_MIN_ROWS,
    SMEM_BYTES_PER_SM,
    GpuPlan,
    GpuRange,
    effective_splits,
    item_kv_range,
    plan_gpu,
    range_work_list,
)
from pallas_kernels.work_model import HARDWARE, KernelWork

F32_FLOP_COST = 6.0  # three TF32 products per float32 product, TF32 at half the dense-bf16 rate (H200: 495 vs 989)


def _batch(plan: GpuPlan, kv_lens, cu_q_lens, num_seqs: int):
    kv = np.zeros(plan.max_seqs, np.int64)
    cu = np.zeros(plan.max_seqs + 1, np.int64)
    kv_in, cu_in = np.asarray(kv_lens, np.int64), np.asarray(cu_q_lens, np.int64)
    kv[:num_seqs] = kv_in[:num_seqs]
    cu[: num_seqs + 1] = cu_in[: num_seqs + 1]
    cu[num_seqs + 1 :] = cu[num_seqs]
    return kv, cu


def program_counts(plan: GpuPlan, rng: GpuRange, kv_lens, cu_q_lens, num_seqs: int, sliding_window: int | None = None):
    """Per program of one range ``[num_splits, num_items, num_kv_heads, 2]``: KV steps walked and distinct pages
    gathered, exactly what the kernel's ``count=True`` output reports; plus the work list's ``seq``, ``n`` and
    each program's page interval ``[first, last]`` (``last < first`` when it reads none)."""
    kv, cu = _batch(plan, kv_lens, cu_q_lens, num_seqs)
    seq, _, n, pos0, _ = (x.astype(np.int64) for x in range_work_list(np, rng, cu, kv, num_seqs))
    k_eff = rng.num_splits
    if rng.adaptive_splits:
        k_eff = int(effective_splits(np, int(np.sum(n > 0)), num_splits=rng.num_splits, num_kv_heads=plan.num_kv_heads))
    split = np.arange(rng.num_splits)[:, None]
    b_lo, b_hi, p_lo, p_hi = item_kv_range(
        np,
        pos0[None, :],
        n[None, :],
        split=split,
        num_splits=k_eff,
        kv_block=rng.kv_block,
        page_size=plan.page_size,
        max_blocks=plan.max_blocks,
        sliding_window=sliding_window,
    )  # [num_splits, num_items]
    ppb = rng.pages_per_block
    steps = np.maximum(b_hi - b_lo, 0)
    first = np.maximum(b_lo * ppb, p_lo)
    last = np.where(steps > 0, np.minimum(b_hi * ppb - 1, p_hi), first - 1)
    counts = np.stack([steps, np.maximum(last - first + 1, 0)], axis=-1)  # [K, I, 2]
    counts = np.broadcast_to(counts[:, :, None, :], (rng.num_splits, rng.num_items, plan.num_kv_heads, 2))
    return counts, seq, n, first, last


def _hbm_pages(plan: GpuPlan, rng: GpuRange, steps, seq, first, last) -> int:
    """The wave model's HBM page reads of one launch (see the module docstring)."""
    h_n = plan.num_kv_heads
    has = steps.T > 0  # [I, K] in launch order within a head
    f_ik, l_ik = first.T[has], last.T[has]
    s_ik = np.broadcast_to(seq[:, None], has.shape)[has]
    per_head = len(f_ik)
    if not per_head:
        return 0
    pos = np.arange(per_head * h_n)
    wave = pos // rng.resident_programs
    head = pos // per_head
    f, l_, sq = np.tile(f_ik, h_n), np.tile(l_ik, h_n), np.tile(s_ik, h_n)
    order = np.lexsort((f, sq, head, wave))
    f, l_, key = f[order], l_[order], ((wave * h_n + head) * plan.max_seqs + sq)[order]
    big = plan.max_blocks + 2
    run = np.maximum.accumulate(key * big + l_ + 1)  # running end of the union within a group
    prev = np.concatenate([[-1], run[:-1]])
    prev_end = np.where(np.concatenate([[False], key[1:] == key[:-1]]), prev - key * big - 1, -1)
    return int(np.maximum(l_ - np.maximum(f, prev_end + 1) + 1, 0).sum())


def gpu_work_detail(
    plan: GpuPlan,
    kv_lens,
    cu_q_lens,
    num_seqs: int,
    sliding_window: int | None = None,
) -> dict[str, Any]:
    """The work of one call for host-known lengths, from the kernel's own plan, work lists and KV ranges.

    Returns a dict: ``work`` (:class:`KernelWork`, ``kv_bytes_read`` under the wave model of the module
    docstring), ``counts`` (per range, :func:`program_counts`), ``kv_steps``, ``pages_gathered`` (``kv_steps *
    pages_per_block``: every slot of every gather, clamped ones included), ``distinct_pages`` (per program,
    summed), ``kv_bytes_gathered`` (distinct pages per program: L2 -> SM traffic with no reuse across programs),
    ``kv_bytes_min`` (every page of every sequence with queries, once per KV head: the least any kernel reads),
    ``grid_programs``, ``programs_in_flight`` (the largest launch's min(programs with work, resident slots)),
    ``h200_seconds`` (:meth:`KernelWork.seconds` on the H200, launches summed)."""
    kv_in, cu_in = np.asarray(kv_lens, np.int64)[:num_seqs], np.asarray(cu_q_lens, np.int64)[: num_seqs + 1]
    q_lens = cu_in[1:] - cu_in[:-1]
    h_n, page, d = plan.num_kv_heads, plan.page_size, plan.head_dim
    # K and V of one KV head, plus their float32 scale rows on quantized (1-byte) pages
    page_bytes = page * d * 2 * plan.itemsize + (page * 2 * 4 if plan.itemsize == 1 else 0)
    q_tok_bytes = plan.num_q_heads * d * plan.q_itemsize
    flop_cost = F32_FLOP_COST if plan.f32_dots else 1.0
    all_counts, works = [], []
    kv_steps = gathered = distinct = grid_programs = in_flight = 0
    for rng in plan.ranges:
        counts, seq, n, first, last = program_counts(plan, rng, kv_lens, cu_q_lens, num_seqs, sliding_window)
        all_counts.append(counts)
        steps = counts[:, :, 0, 0]  # [K, I], the same for every KV head
        r_steps = int(steps.sum()) * h_n
        kv_steps += r_steps
        gathered += r_steps * rng.pages_per_block
        distinct += int(counts[:, :, 0, 1].sum()) * h_n
        programs = int((steps > 0).sum()) * h_n
        grid_programs += rng.num_splits * rng.num_items * h_n
        in_flight = max(in_flight, min(programs, rng.resident_programs))
        tokens = int(n.sum())
        q_bytes = tokens * q_tok_bytes * rng.num_splits  # every split's program loads its item's rows
        if rng.num_splits == 1:
            out_bytes = tokens * q_tok_bytes
        else:  # partials (the real rows of programs with work) written, read back by the combine kernel
            row_steps = (steps > 0).sum(axis=0) * n  # [I]: tokens x splits with work
            out_bytes = 2 * int(row_steps.sum()) * plan.group * h_n * (d + 2) * 4 + tokens * q_tok_bytes
        works.append(
            KernelWork(
                kv_bytes_read=_hbm_pages(plan, rng, steps, seq, first, last) * page_bytes,
                q_bytes=q_bytes,
                out_bytes=out_bytes,
                issued_flops=r_steps * 2 * 2 * max(rng.rows, MMA_MIN_ROWS) * rng.kv_block * d,
                useful_flops=0,
                exps=r_steps * rng.rows * (rng.kv_block + 1),
                programs=programs,
                flop_cost=flop_cost,
            )
        )
    pos_q = [np.arange(k - q, k) for k, q in zip(kv_in, q_lens, strict=True)]
    seen = [x + 1 if sliding_window is None else np.minimum(x + 1, sliding_window) for x in pos_q]
    useful = int(sum(int(x.sum()) for x in seen)) * plan.num_q_heads * 2 * 2 * d
    work = KernelWork(
        kv_bytes_read=sum(w.kv_bytes_read for w in works),
        q_bytes=sum(w.q_bytes for w in works),
        out_bytes=sum(w.out_bytes for w in works) + plan.num_tokens * q_tok_bytes,  # + the output's zero fill
        issued_flops=sum(w.issued_flops for w in works),
        useful_flops=useful,
        exps=sum(w.exps for w in works),
        programs=sum(w.programs for w in works),
        flop_cost=flop_cost,
    )
    min_pages = sum(cdiv(int(k), page) for k, q in zip(kv_in, q_lens, strict=True) if q > 0)
    return dict(
        work=work,
        counts=tuple(all_counts),
        kv_steps=kv_steps,
        pages_gathered=gathered,
        distinct_pages=distinct,
        kv_bytes_gathered=distinct * page_bytes,
        kv_bytes_min=min_pages * page_bytes * h_n,
        grid_programs=grid_programs,
        programs_in_flight=in_flight,
        h200_seconds=sum(w.seconds(HARDWARE["h200"]) for w in works),
    )


def gpu_work(plan: GpuPlan, kv_lens, cu_q_lens, num_seqs: int, sliding_window: int | None = None) -> KernelWork:
    """:class:`KernelWork` of one call of the GPU kernel under ``plan`` for concrete lengths (the same arguments
    as ``tpu_plan.tpu_work``); details in :func:`gpu_work_detail`."""
    return gpu_work_detail(plan, kv_lens, cu_q_lens, num_seqs, sliding_window)["work"]


def case_work(
    num_tokens: int,
    max_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype,
    kv_lens,
    cu_q_lens,
    num_seqs: int,
    *,
    previous: bool = False,
    max_blocks: int | None = None,
    sliding_window: int | None = None,
) -> KernelWork:
    """:class:`KernelWork` of one call in a ``(num_tokens, max_seqs)`` bucket for host-known lengths: the
    current kernel (:func:`gpu_work` on :func:`plan_gpu`) or, with ``previous=True``, the previous design
    (:func:`legacy_gpu_work`). ``max_blocks`` (block-table width) defaults to the longest sequence's pages."""
    kv = np.asarray(kv_lens, np.int64)[:num_seqs]
    max_blocks = max_blocks or max(1, cdiv(int(kv.max(initial=1)), page_size))
    if previous:
        return legacy_gpu_work(
            num_tokens,
            max_seqs,
            num_q_heads,
            num_kv_heads,
            head_dim,
            page_size,
            dtype,
            kv_lens,
            cu_q_lens,
            num_seqs,
            max_blocks=max_blocks,
        )
    plan = plan_gpu(num_tokens, max_seqs, max_blocks, num_q_heads, num_kv_heads, head_dim, page_size, dtype)
    return gpu_work(plan, kv_lens, cu_q_lens, num_seqs, sliding_window)


def legacy_gpu_work(
    num_tokens: int,
    max_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype,
    kv_lens,
    cu_q_lens,
    num_seqs: int,
    *,
    max_blocks: int,
) -> KernelWork:
    """The previous GPU kernel (before issue 10), re-derived from its code: grid ``(num_kv_heads, num_tokens /
    q_block)`` with ``q_block = 16 // group_p`` tokens for decode buckets (``T <= 2 S``) and ``64 // group_p``
    otherwise; a program walks every sequence with a token in its block, one after another, and for each every
    KV block of ``64 // page_size`` pages (at least one) up to that sequence's last query in the block,
    computing all ``q_block * group_p`` rows; no split-KV, ``num_stages=2``, ``num_warps=4``. HBM bytes use the
    same wave model as :func:`gpu_work_detail` (launch order: KV head fastest, then block); table padding
    entries gather the null page, counted as gathered, not as HBM reads. No sliding window."""
    group = num_q_heads // num_kv_heads
    group_p = 1 << (group - 1).bit_length()
    target_rows = 16 if num_tokens <= 2 * max_seqs else 64
    q_block = max(1, min(num_tokens, target_rows // group_p))
    while num_tokens % q_block:  # the old wrapper required q_block | num_tokens
        q_block -= 1
    ppb = min(max(1, 64 // page_size), 1 << (max_blocks - 1).bit_length())
    kv_block = ppb * page_size
    rows = q_block * group_p
    itemsize = jnp.dtype(dtype).itemsize
    smem = 2 * kv_block * head_dim * 2 * itemsize + rows * head_dim * itemsize
    resident = HARDWARE["h200"].num_cores * max(1, min(4, SMEM_BYTES_PER_SM // smem))
    kv = np.asarray(kv_lens, np.int64)
    cu = np.asarray(cu_q_lens, np.int64)
    total = int(cu[num_seqs])
    steps = 0
    programs = []  # per (block): list of (seq, first page, last page)
    for start in range(0, num_tokens, q_block):
        spans = []
        for s in range(num_seqs):
            lo, hi = max(int(cu[s]), start), min(int(cu[s + 1]), start + q_block, total)
            if lo >= hi:
                continue
            last_pos = int(kv[s]) - int(cu[s + 1] - cu[s]) + (hi - int(cu[s])) - 1
            b_hi = last_pos // kv_block + 1
            steps += b_hi
            spans.append((s, 0, min(b_hi * ppb, cdiv(int(kv[s]), page_size)) - 1))
        if spans:
            programs.append(spans)
    hbm_pages = 0
    seen: dict[tuple[int, int, int], int] = {}  # (seq, head, wave) -> pages read so far (spans start at 0)
    for b, spans in enumerate(programs):  # launch order: KV head fastest, then block
        for h in range(num_kv_heads):
            wave = (b * num_kv_heads + h) // resident
            for s, _, last in spans:
                done = seen.get((s, h, wave), 0)
                if last + 1 > done:
                    hbm_pages += last + 1 - done
                    seen[(s, h, wave)] = last + 1
    page_bytes = page_size * head_dim * 2 * itemsize
    q_tok_bytes = num_q_heads * head_dim * itemsize
    q_lens = np.diff(cu[: num_seqs + 1])
    pairs = sum(int(np.sum(np.arange(k - q, k) + 1)) for k, q in zip(kv[:num_seqs], q_lens, strict=True))
    return KernelWork(
        kv_bytes_read=hbm_pages * page_bytes,
        # q transposed and padded in XLA (read + write), then read by the kernel; output likewise back.
        q_bytes=3 * num_tokens * q_tok_bytes,
        out_bytes=3 * num_tokens * q_tok_bytes,
        issued_flops=steps * num_kv_heads * 2 * 2 * max(rows, MMA_MIN_ROWS) * kv_block * head_dim,
        useful_flops=pairs * num_q_heads * 2 * 2 * head_dim,
        exps=steps * num_kv_heads * rows * (kv_block + 1),
        programs=len(programs) * num_kv_heads,
    )
