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

**Split-KV (flash-decoding).** When items x KV heads is below about twice the SM count (132 on H200), each
item's KV range is cut into ``num_splits`` contiguous chunks of KV blocks, one program each; programs write
unnormalised partials ``(m, l, acc)`` and an XLA pass combines them exactly (``exp(m_k - max m)`` weights), then
gathers the rows back to token order. Splits past a short sequence's end write ``m = MASK_VALUE, l = 0`` and
drop out of the combine.

**KV loop.** A KV step is ``pages_per_block`` pages gathered with one indexed load (``k_ref[pages]``). The
table entries of the *next* step are loaded one step ahead (carried through the loop), so the gather of step
``b + 1`` never waits on its own block-table load and Triton can pipeline it over ``num_stages``. Table indices
outside the item's page range (past its last visible key, or before a sliding window) are clamped to the range,
so such slots re-read a page already in L1/L2 instead of fetching a new one from HBM; they are masked out.
Online softmax in float32 with a finite mask value; V rows outside the visible range are zeroed so stale or
NaN slots cannot leak.

**Plan and work model.** :func:`plan_gpu` (static shapes only) picks ``q_block``, ``pages_per_block``,
``num_splits``, ``num_warps`` and ``num_stages`` from :data:`TUNED_BLOCK_CONFIGS` (keyed by head_dim,
page size, dtype; a heuristic otherwise) and is what the kernel wrapper itself runs. :func:`gpu_work` runs the
same plan, the same :func:`work_list` and the same per-program KV range (:func:`item_kv_range`) in numpy for
host-known lengths and returns :class:`pallas_kernels.work_model.KernelWork`. ``kv_bytes_read`` counts HBM
traffic: pages a program gathers are counted once per *wave* (the programs resident at once, SMs x programs per
SM, in launch order) and stream (sequence, KV head) -- programs of one wave that read the same page share one
HBM read through the L2 (50 MB on H200), programs of different waves do not. ``gpu_work_detail`` also reports
the bytes gathered into SMs (L2 -> SM) without that assumption. The pallas_call gets a
``pl.CostEstimate`` from the plan at its static worst case (every slot full, every table full).

**Why Triton and not Mosaic GPU.** In jax 0.11.2 the Triton lowering is the mature path for a page gather:
programs load through computed pointers, so "the pages named by this block-table row" is one indexed load that
Triton software-pipelines, on every CUDA GPU JAX supports. jax 0.11.2 already warns that Pallas-Triton is
deprecated; we pin jax. A Mosaic GPU port would need: (1) one TMA copy per page (a page of one KV head is a
contiguous ``[page_size, 2 * head_dim]`` tile in this layout, TMA-friendly) issued by a producer warp into a
ring of shared-memory slots with ``plgpu.barrier`` arrive/wait per slot, the block-table row read from SMEM
(copied in first) to form the TMA coordinates; (2) wgmma-shaped tiles: 64-row warpgroup M tiles, so decode
packs 4 KV heads' groups (or 64 // group tokens) per warpgroup instead of 16 rows; (3) warp specialisation
(producer / two consumer warpgroups) and the split-KV combine as a second small kernel or a cluster reduction;
(4) Hopper or newer (sm_90a) only, so the Triton kernel stays for Ampere/Ada; (5) the same plan/work list,
which is independent of the lowering."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import MASK_VALUE, apply_soft_cap, cdiv, validate_kernel_shape
from pallas_kernels.work_model import HARDWARE, KernelWork

MMA_MIN_ROWS = 16  # tl.dot needs M, N, K >= 16
H200_SMS = HARDWARE["h200"].num_cores
H200_L2_BYTES = 50 * 2**20
SMEM_BYTES_PER_SM = 227 * 1024
MIN_KEYS_PER_SPLIT = 256  # a split shorter than this costs more in partials and launch than it hides
MAX_SPLITS = 32


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Tiling of one kind of bucket: query rows per program, keys per KV step, Triton launch options."""

    rows: int  # target rows of a program's q tile (tokens x padded group), >= 16
    kv_keys: int  # keys per KV step (pages_per_block * page_size)
    num_warps: int
    num_stages: int


# (head_dim, page_size, dtype name) -> (decode config, prefill config). Starting points from the public Triton
# flash-attention / vLLM unified-attention tunings for Hopper, NOT yet measured on our kernel (no GPU has run
# it): decode tiles are the 16-row MMA minimum with long KV steps and deep pipelines (bandwidth-bound), prefill
# tiles 64-128 rows with 64-key steps (register-bound accumulators).
TUNED_BLOCK_CONFIGS: dict[tuple[int, int, str], tuple[BlockConfig, BlockConfig]] = {
    (64, 16, "bfloat16"): (BlockConfig(16, 128, 4, 4), BlockConfig(128, 64, 4, 3)),
    (64, 32, "bfloat16"): (BlockConfig(16, 128, 4, 4), BlockConfig(128, 64, 4, 3)),
    (64, 64, "bfloat16"): (BlockConfig(16, 128, 4, 4), BlockConfig(128, 64, 4, 3)),
    (128, 16, "bfloat16"): (BlockConfig(16, 64, 4, 3), BlockConfig(128, 64, 8, 3)),
    (128, 32, "bfloat16"): (BlockConfig(16, 64, 4, 3), BlockConfig(128, 64, 8, 3)),
    (128, 64, "bfloat16"): (BlockConfig(16, 64, 4, 3), BlockConfig(128, 64, 8, 3)),
    (256, 16, "bfloat16"): (BlockConfig(16, 32, 4, 3), BlockConfig(64, 32, 8, 2)),
    (256, 32, "bfloat16"): (BlockConfig(16, 32, 4, 3), BlockConfig(64, 32, 8, 2)),
    (256, 64, "bfloat16"): (BlockConfig(16, 64, 4, 2), BlockConfig(64, 64, 8, 2)),
}


def block_configs(head_dim: int, page_size: int, dtype: Any) -> tuple[BlockConfig, BlockConfig]:
    """``(decode, prefill)`` configs: the table's entry, else a heuristic (float32 halves the KV step)."""
    name = jnp.dtype(dtype).name
    if (head_dim, page_size, name) in TUNED_BLOCK_CONFIGS:
        return TUNED_BLOCK_CONFIGS[(head_dim, page_size, name)]
    scale = 2 if name == "float32" else 1
    decode_keys = max(16, 8192 // head_dim // scale)  # 64 keys at head_dim 128 (bf16)
    prefill_rows = 128 if head_dim <= 128 else 64
    return (
        BlockConfig(16, decode_keys, 4, 3 if scale == 1 else 2),
        BlockConfig(prefill_rows, max(16, 64 // scale), 8 if head_dim >= 128 else 4, 2),
    )


@dataclasses.dataclass(frozen=True)
class GpuPlan:
    """Everything static about one call of the GPU kernel (what :func:`plan_gpu` decides)."""

    num_tokens: int
    max_seqs: int
    max_blocks: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    itemsize: int  # of the KV pages (and the q tile)
    q_itemsize: int
    group: int  # query heads per KV head
    group_p: int  # padded to a power of two
    q_block: int  # tokens per work item
    rows: int  # q_block * group_p, >= 16
    pages_per_block: int
    kv_block: int  # keys per KV step
    num_items: int  # static bound on work items
    num_splits: int
    num_warps: int
    num_stages: int
    decode: bool  # which config row was used
    adaptive_splits: bool  # True: the kernel uses effective_splits() of the grid's num_splits
    programs_per_sm: int  # estimated residency (shared memory bound), for the wave model

    @property
    def grid(self) -> tuple[int, int, int]:
        """``(num_splits, num_items, num_kv_heads)``; the first axis varies fastest in launch order."""
        return (self.num_splits, self.num_items, self.num_kv_heads)

    @property
    def resident_programs(self) -> int:
        return H200_SMS * self.programs_per_sm


def plan_gpu(
    num_tokens: int,
    max_seqs: int,
    max_blocks: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: Any = jnp.bfloat16,
    q_dtype: Any | None = None,
    *,
    q_block: int | None = None,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_sms: int = H200_SMS,
) -> GpuPlan:
    """The kernel's static plan for a bucket. Overrides (tests, tuning) are rounded up to the MMA minimums."""
    group = num_q_heads // num_kv_heads
    group_p = 1 << (group - 1).bit_length()
    decode = num_tokens <= 2 * max_seqs
    cfg = block_configs(head_dim, page_size, dtype)[0 if decode else 1]
    q_block = q_block or max(1, cfg.rows // group_p)
    q_block = 1 << (q_block - 1).bit_length()
    q_block = max(q_block, cdiv(MMA_MIN_ROWS, group_p))
    rows = q_block * group_p
    ppb = pages_per_block or max(1, cfg.kv_keys // page_size)
    ppb = max(1 << (ppb - 1).bit_length(), cdiv(MMA_MIN_ROWS, page_size))
    ppb = min(ppb, max(1 << (max_blocks - 1).bit_length(), cdiv(MMA_MIN_ROWS, page_size)))
    kv_block = ppb * page_size
    n_min = min(max_seqs, num_tokens)
    num_items = max(1, n_min + (num_tokens - n_min) // q_block)
    adaptive = num_splits is None
    if num_splits is None:
        # The grid's split axis is sized for the smallest batch this bucket is likely to hold (one more than
        # half its sequence slots: the previous power-of-two bucket holds the rest); the kernel then uses only
        # as many splits as the real item count needs (:func:`effective_splits`), the others exit at once.
        likely_items = n_min // 2 + 1 if decode else num_items
        base = likely_items * num_kv_heads
        num_splits = 1
        if base < 2 * num_sms:
            most = max(1, min(MAX_SPLITS, max_blocks * page_size // MIN_KEYS_PER_SPLIT))
            num_splits = max(1, min(cdiv(2 * num_sms, base), most))
    itemsize = jnp.dtype(dtype).itemsize
    num_stages = num_stages or cfg.num_stages
    smem = num_stages * kv_block * head_dim * 2 * itemsize + rows * head_dim * itemsize
    return GpuPlan(
        num_tokens=num_tokens,
        max_seqs=max_seqs,
        max_blocks=max_blocks,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        itemsize=itemsize,
        q_itemsize=jnp.dtype(q_dtype or dtype).itemsize,
        group=group,
        group_p=group_p,
        q_block=q_block,
        rows=rows,
        pages_per_block=ppb,
        kv_block=kv_block,
        num_items=num_items,
        num_splits=num_splits,
        num_warps=num_warps or cfg.num_warps,
        num_stages=num_stages,
        decode=decode,
        adaptive_splits=adaptive and num_splits > 1,
        programs_per_sm=max(1, min(4, SMEM_BYTES_PER_SM // smem)),
    )


def work_list(xp, cu_q_lens, kv_lens, num_seqs, *, q_block: int, num_items: int):
    """The ``(sequence, q-block)`` items, in sequence order; ``xp`` is ``numpy`` or ``jax.numpy``.

    Returns int32 arrays of length ``num_items``: ``seq`` (owner), ``tok0`` (flat index of its first token),
    ``n`` (its tokens, 0 for an empty item past the real ones), ``pos0`` (position of its first token),
    ``kv_len`` (the owner's keys), plus ``starts`` (per sequence, its first item). The kernel and the work
    model both call this."""
    i32 = lambda x: xp.asarray(x).astype(xp.int32)
    max_seqs = kv_lens.shape[0]
    slot = xp.arange(max_seqs, dtype=xp.int32)
    q_lens = xp.where(slot < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    n_items = (q_lens + q_block - 1) // q_block
    ends = i32(xp.cumsum(n_items))
    starts = ends - n_items
    item = xp.arange(num_items, dtype=xp.int32)
    seq = xp.minimum(i32(xp.searchsorted(ends, item, side="right")), max_seqs - 1)
    real = item < ends[-1]
    off = (item - starts[seq]) * q_block
    n = xp.where(real, xp.clip(q_lens[seq] - off, 0, q_block), 0)
    tok0 = cu_q_lens[seq] + off
    pos0 = kv_lens[seq] - q_lens[seq] + off
    return i32(seq), i32(tok0), i32(n), i32(pos0), i32(kv_lens[seq]), i32(starts)


def effective_splits(xp, real_items, *, num_splits: int, num_kv_heads: int, num_sms: int = H200_SMS):
    """Splits the call actually uses, at most the grid's ``num_splits``: enough that real items x KV heads x
    splits reaches twice the SM count. A device scalar in the wrapper, an int in the work model."""
    want = (2 * num_sms + real_items * num_kv_heads - 1) // xp.maximum(real_items * num_kv_heads, 1)
    return xp.clip(want, 1, num_splits)


def item_kv_range(xp, pos0, n, *, split, num_splits, kv_block: int, page_size: int, max_blocks: int,
                  sliding_window: int | None):
    """KV blocks ``[b_lo, b_hi)`` one program (item, split) walks, and the item's visible pages
    ``[p_lo, p_hi]`` (clamped to the table; every gather index is clamped into it). Scalars in the kernel,
    arrays in the work model."""
    last = pos0 + n - 1
    first_key = xp.zeros_like(pos0) if sliding_window is None else xp.maximum(pos0 - sliding_window + 1, 0)
    lo = first_key // kv_block
    hi = xp.where(n > 0, last // kv_block + 1, lo)
    per = (hi - lo + num_splits - 1) // num_splits
    b_lo = xp.minimum(lo + split * per, hi)
    b_hi = xp.minimum(b_lo + per, hi)
    p_lo = xp.minimum(first_key // page_size, max_blocks - 1)
    p_hi = xp.clip(last // page_size, p_lo, max_blocks - 1)
    return b_lo, b_hi, p_lo, p_hi


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
    *refs,  # (zeros, o) when num_splits == 1, else (acc, m, l); then stats when counting
    plan: GpuPlan,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    count: bool,
):
    qb, gp, group, d, ppb, page = (plan.q_block, plan.group_p, plan.group, plan.head_dim, plan.pages_per_block,
                                   plan.page_size)
    rows, kv_block = plan.rows, plan.kv_block
    split, item, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s, tok0, n, pos0 = seq_ref[item], tok0_ref[item], n_ref[item], pos0_ref[item]

    j3 = jax.lax.broadcasted_iota(jnp.int32, (qb, gp, 1), 0)
    g3 = jax.lax.broadcasted_iota(jnp.int32, (qb, gp, 1), 1)
    row_ok3 = jnp.broadcast_to((j3 < n) & (g3 < group), (qb, gp, d))
    q_view = q_ref.at[pl.ds(tok0, qb), pl.ds(h * group, gp)]
    q = pltriton.load(q_view, mask=row_ok3, other=0).reshape(rows, d).astype(k_ref.dtype)
    r = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    q_pos = pos0 + r // gp  # [rows, 1]
    row_real = r // gp < n

    b_lo, b_hi, p_lo, p_hi = item_kv_range(
        jnp, pos0, n, split=split, num_splits=splits_ref[0], kv_block=kv_block, page_size=page,
        max_blocks=plan.max_blocks, sliding_window=sliding_window,
    )
    page_iota = jax.lax.broadcasted_iota(jnp.int32, (ppb,), 0)

    def table_entries(b):  # the pages of KV step b, out-of-range slots clamped onto the item's pages
        return tables_ref[s, jnp.clip(b * ppb + page_iota, p_lo, p_hi)]

    def kv_body(b, carry):
        m, den, acc, pages, stats = carry
        next_pages = table_entries(b + 1)  # one step ahead: the next gather's addresses are ready
        k = k_ref[pages].reshape(kv_block, d)
        v = v_ref[pages].reshape(kv_block, d)
        k_pos = b * kv_block + jax.lax.broadcasted_iota(jnp.int32, (1, kv_block), 1)
        mask = row_real & (k_pos <= q_pos)
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        logits = pltriton.dot(q, k, trans_b=True, allow_tf32=False) * sm_scale  # float32 accumulate
        logits = jnp.where(mask, apply_soft_cap(logits, soft_cap), MASK_VALUE)
        m_next = jnp.maximum(m, jnp.max(logits, axis=1))
        alpha = jnp.exp(m - m_next)
        p = jnp.where(mask, jnp.exp(logits - m_next[:, None]), 0.0)
        v_pos = b * kv_block + jax.lax.broadcasted_iota(jnp.int32, (kv_block, 1), 0)
        v = jnp.where((v_pos >= p_lo * page) & (v_pos <= pos0 + n - 1), v, jnp.zeros_like(v))
        acc = alpha[:, None] * acc + pltriton.dot(p.astype(v.dtype), v, allow_tf32=False)
        if count:  # KV steps, and distinct in-range pages gathered (the clamped slots re-read one of them)
            first, last = jnp.maximum(b * ppb, p_lo), jnp.minimum(b * ppb + ppb - 1, p_hi)
            stats = stats + jnp.where(jnp.arange(2) == 0, 1, jnp.maximum(last - first + 1, 0))
        return m_next, alpha * den + jnp.sum(p, axis=1), acc, next_pages, stats

    init = (
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, d), jnp.float32),
        table_entries(b_lo),
        jnp.zeros((2,), jnp.int32) if count else None,
    )
    m, den, acc, _, stats = jax.lax.fori_loop(b_lo, b_hi, kv_body, init)
    if count:
        refs, stats_ref = refs[:-1], refs[-1]
        stats_ref[...] = stats
    if plan.num_splits == 1:
        _, o_ref = refs
        out = jnp.where(den[:, None] > 0, acc / jnp.where(den > 0, den, 1.0)[:, None], 0.0)
        out = out.reshape(qb, gp, d).astype(o_ref.dtype)
        pltriton.store(o_ref.at[pl.ds(tok0, qb), pl.ds(h * group, gp)], out, mask=row_ok3)
    else:
        acc_ref, m_ref, l_ref = refs
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = den


def _static_cost(plan: GpuPlan, sliding_window: int | None) -> pl.CostEstimate:
    """Cost estimate at the bucket's worst case (the only case known at trace time): ``min(S, T)`` sequences
    sharing the tokens evenly, each with a full block table of keys."""
    n_seqs = min(plan.max_seqs, plan.num_tokens)
    q_lens = np.full(n_seqs, plan.num_tokens // n_seqs)
    q_lens[0] += plan.num_tokens - q_lens.sum()
    kv_lens = np.maximum(plan.max_blocks * plan.page_size, q_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    work = gpu_work(plan, kv_lens, cu, n_seqs, sliding_window)
    return pl.CostEstimate(flops=work.issued_flops, transcendentals=work.exps, bytes_accessed=work.hbm_bytes)


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
        "count",
    ),
)
def ragged_paged_attention_gpu(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, num_kv_heads, page_size, 2 * head_dim]
    kv_lens: jax.Array,  # [max_seqs] int32
    block_tables: jax.Array,  # [max_seqs, max_blocks_per_seq] int32
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool = False,
    q_block: int | None = None,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    count: bool = False,
):
    """Ragged paged attention on GPU; returns ``[num_tokens, num_q_heads, head_dim]`` in ``q.dtype``.

    Tiling comes from :func:`plan_gpu`; the keyword overrides are for tests and tuning. ``interpret=True`` runs
    the kernel in the Pallas interpreter (CPU is fine). ``count=True`` (tests) also returns per-program
    ``[num_splits, num_items, num_kv_heads, 2]`` int32 counters: KV steps walked, distinct pages gathered.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = kv_pages.shape
    max_seqs, max_blocks = block_tables.shape
    validate_kernel_shape(head_dim, page_size)
    plan = plan_gpu(
        num_tokens, max_seqs, max_blocks, num_q_heads, num_kv_heads, head_dim, page_size, kv_pages.dtype,
        q.dtype, q_block=q_block, pages_per_block=pages_per_block, num_splits=num_splits,
        num_warps=num_warps, num_stages=num_stages,
    )
    seq, tok0, n, pos0, _, starts = work_list(
        jnp, cu_q_lens, kv_lens, num_seqs[0], q_block=plan.q_block, num_items=plan.num_items
    )
    splits = jnp.full((1,), plan.num_splits, jnp.int32)
    if plan.adaptive_splits:
        real_items = jnp.sum(n > 0).astype(jnp.int32)
        splits = effective_splits(jnp, real_items, num_splits=plan.num_splits, num_kv_heads=num_kv_heads)[None]
    nsp, ni, nh, rows, d = plan.num_splits, plan.num_items, num_kv_heads, plan.rows, head_dim
    full = lambda x: pl.BlockSpec(x.shape, lambda k, i, h: (0,) * x.ndim)
    kv_spec = lambda half: pl.BlockSpec(
        (kv_pages.shape[0], None, page_size, head_dim), lambda k, i, h: (0, h, 0, half)
    )
    meta = (seq, tok0, n, pos0, splits, block_tables)
    in_specs = [full(x) for x in meta] + [full(q), kv_spec(0), kv_spec(1)]
    args = [*meta, q, kv_pages, kv_pages]
    aliases = {}
    if nsp == 1:
        zeros = jnp.zeros(q.shape, q.dtype)  # padding tokens' rows stay zero; real rows are all written
        in_specs.append(full(zeros))
        aliases = {len(args): 0}
        args.append(zeros)
        out_specs = [full(zeros)]
        out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
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
        _kernel, plan=plan, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, count=count
    )
    outs = pl.pallas_call(
        kernel,
        grid=plan.grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=plan.num_warps, num_stages=plan.num_stages),
        cost_estimate=_static_cost(plan, sliding_window),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*args)
    if nsp == 1:
        out = outs[0]
    else:
        out = _combine_splits(outs[0], outs[1], outs[2], cu_q_lens, num_seqs, starts, plan).astype(q.dtype)
    return (out, outs[-1]) if count else out


def _combine_splits(acc, m, den_k, cu_q_lens, num_seqs, starts, plan: GpuPlan) -> jax.Array:
    """Flash-decoding reduction of the splits' partials, then item rows back to token order (zeros for padding
    tokens). ``acc [K, I, H, rows, D]``, ``m, den_k [K, I, H, rows]``."""
    m_max = jnp.max(m, axis=0)
    w = jnp.exp(m - m_max)  # empty splits: m = MASK_VALUE, l = 0, acc = 0
    den = jnp.sum(w * den_k, axis=0)
    num = jnp.sum(w[..., None] * acc, axis=0)
    out = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    out = out.reshape(plan.num_items, plan.num_kv_heads, plan.q_block, plan.group_p, plan.head_dim)
    t = jnp.arange(plan.num_tokens, dtype=jnp.int32)
    s = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1, 0, plan.max_seqs - 1)
    off = t - cu_q_lens[s]
    item = jnp.clip(starts[s] + off // plan.q_block, 0, plan.num_items - 1)
    heads = jnp.arange(plan.num_kv_heads)
    out = out[item[:, None], heads[None, :], (off % plan.q_block)[:, None]][:, :, : plan.group]
    out = jnp.where((t < cu_q_lens[num_seqs[0]])[:, None, None, None], out, 0.0)
    return out.reshape(plan.num_tokens, plan.num_q_heads, plan.head_dim)


# ----------------------------------------------------------------------------------------------------------
# Work model


def gpu_plan_for(q_shape, kv_pages_shape, max_seqs: int, max_blocks: int, dtype, q_dtype=None,
                 **overrides) -> GpuPlan:
    """The kernel's static plan for one call's shapes (what :func:`ragged_paged_attention_gpu` uses);
    ``overrides``: ``q_block, pages_per_block, num_splits, num_warps, num_stages`` as the kernel takes them."""
    num_tokens, num_q_heads, head_dim = q_shape
    _, num_kv_heads, page_size, _ = kv_pages_shape
    return plan_gpu(num_tokens, max_seqs, max_blocks, num_q_heads, num_kv_heads, head_dim, page_size, dtype,
                    q_dtype, **overrides)


def program_counts(plan: GpuPlan, kv_lens, cu_q_lens, num_seqs: int, sliding_window: int | None = None):
    """Per program ``[num_splits, num_items, num_kv_heads, 2]``: KV steps walked and distinct pages gathered,
    exactly what the kernel's ``count=True`` output reports; plus the work list's ``seq`` and each program's
    page interval ``[first, last]`` (``last < first`` when it reads none)."""
    kv = np.zeros(plan.max_seqs, np.int64)
    cu = np.zeros(plan.max_seqs + 1, np.int64)
    kv_in, cu_in = np.asarray(kv_lens, np.int64), np.asarray(cu_q_lens, np.int64)
    kv[:num_seqs] = kv_in[:num_seqs]
    cu[: num_seqs + 1] = cu_in[: num_seqs + 1]
    cu[num_seqs + 1 :] = cu[num_seqs]
    seq, _, n, pos0, _, _ = (x.astype(np.int64) for x in work_list(
        np, cu, kv, num_seqs, q_block=plan.q_block, num_items=plan.num_items))
    k_eff = plan.num_splits
    if plan.adaptive_splits:
        k_eff = int(effective_splits(np, int(np.sum(n > 0)), num_splits=plan.num_splits,
                                     num_kv_heads=plan.num_kv_heads))
    split = np.arange(plan.num_splits)[:, None]
    b_lo, b_hi, p_lo, p_hi = item_kv_range(
        np, pos0[None, :], n[None, :], split=split, num_splits=k_eff, kv_block=plan.kv_block,
        page_size=plan.page_size, max_blocks=plan.max_blocks, sliding_window=sliding_window,
    )  # [num_splits, num_items]
    ppb = plan.pages_per_block
    steps = np.maximum(b_hi - b_lo, 0)
    first = np.maximum(b_lo * ppb, p_lo)
    last = np.where(steps > 0, np.minimum(b_hi * ppb - 1, p_hi), first - 1)
    counts = np.stack([steps, np.maximum(last - first + 1, 0)], axis=-1)  # [K, I, 2]
    counts = np.broadcast_to(counts[:, :, None, :], (plan.num_splits, plan.num_items, plan.num_kv_heads, 2))
    return counts, seq, first, last


def gpu_work_detail(plan: GpuPlan, kv_lens, cu_q_lens, num_seqs: int, sliding_window: int | None = None,
                    ) -> dict[str, Any]:
    """The work of one call for host-known lengths, from the kernel's own plan, work list and KV ranges.

    Returns a dict: ``work`` (:class:`KernelWork`, ``kv_bytes_read`` under the L2 wave model of the module
    docstring), ``counts`` (:func:`program_counts`), ``kv_steps``, ``pages_gathered`` (``kv_steps *
    pages_per_block``: every slot of every gather, clamped ones included), ``distinct_pages`` (per program,
    summed), ``kv_bytes_gathered`` (distinct pages per program: L2 -> SM traffic with no reuse across programs),
    ``kv_bytes_min`` (every page of every sequence with queries, once per KV head: the least any kernel reads),
    ``grid_programs``, ``programs_in_flight`` (min(programs with work, resident slots))."""
    counts, seq, first, last = program_counts(plan, kv_lens, cu_q_lens, num_seqs, sliding_window)
    kv_in, cu_in = np.asarray(kv_lens, np.int64)[:num_seqs], np.asarray(cu_q_lens, np.int64)[: num_seqs + 1]
    q_lens = cu_in[1:] - cu_in[:-1]
    h_n, page, d, rows = plan.num_kv_heads, plan.page_size, plan.head_dim, plan.rows
    page_bytes = page * d * 2 * plan.itemsize  # K and V of one KV head
    steps = counts[:, :, 0, 0]  # [K, I], the same for every KV head
    kv_steps = int(steps.sum()) * h_n
    distinct = int(counts[:, :, 0, 1].sum()) * h_n
    # HBM: programs with work in launch order (split fastest, then item, then KV head); within one wave of
    # resident programs, the programs of one stream (sequence, KV head) share each page's HBM read.
    has = steps.T > 0  # [I, K] in launch order within a head
    f_ik, l_ik = first.T[has], last.T[has]
    s_ik = np.broadcast_to(seq[:, None], has.shape)[has]
    per_head = len(f_ik)
    pos = np.arange(per_head * h_n)
    wave = pos // plan.resident_programs
    head = pos // max(per_head, 1)
    f, l_, sq = np.tile(f_ik, h_n), np.tile(l_ik, h_n), np.tile(s_ik, h_n)
    hbm_pages = 0
    if len(pos):
        order = np.lexsort((f, sq, head, wave))
        f, l_, key = f[order], l_[order], ((wave * h_n + head) * plan.max_seqs + sq)[order]
        big = plan.max_blocks + 2
        run = np.maximum.accumulate(key * big + l_ + 1)  # running end of the union within a group
        prev = np.concatenate([[-1], run[:-1]])
        prev_end = np.where(np.concatenate([[False], key[1:] == key[:-1]]), prev - key * big - 1, -1)
        hbm_pages = int(np.maximum(l_ - np.maximum(f, prev_end + 1) + 1, 0).sum())
    issued = kv_steps * 2 * 2 * max(rows, MMA_MIN_ROWS) * plan.kv_block * d
    pos_q = [np.arange(k - q, k) for k, q in zip(kv_in, q_lens, strict=True)]
    seen = [x + 1 if sliding_window is None else np.minimum(x + 1, sliding_window) for x in pos_q]
    useful = int(sum(int(x.sum()) for x in seen)) * plan.num_q_heads * 2 * 2 * d
    exps = kv_steps * rows * (plan.kv_block + 1)
    q_tok_bytes = plan.num_q_heads * d * plan.q_itemsize
    real_tokens = int(q_lens.sum())
    q_bytes = real_tokens * q_tok_bytes * plan.num_splits  # every split's program loads its item's rows
    if plan.num_splits == 1:  # zero fill of the output, then the real rows
        out_bytes = (plan.num_tokens + real_tokens) * q_tok_bytes
    else:  # partials written, read back by the combine, which writes every row
        partial = plan.num_splits * plan.num_items * h_n * rows * (d + 2) * 4
        out_bytes = 2 * partial + plan.num_tokens * q_tok_bytes
    min_pages = sum(cdiv(int(k), page) for k, q in zip(kv_in, q_lens, strict=True) if q > 0)
    programs = per_head * h_n
    return dict(
        work=KernelWork(
            kv_bytes_read=hbm_pages * page_bytes,
            q_bytes=q_bytes,
            out_bytes=out_bytes,
            issued_flops=issued,
            useful_flops=useful,
            exps=exps,
            programs=programs,
        ),
        counts=counts,
        kv_steps=kv_steps,
        pages_gathered=kv_steps * plan.pages_per_block,
        distinct_pages=distinct,
        kv_bytes_gathered=distinct * page_bytes,
        kv_bytes_min=min_pages * page_bytes * h_n,
        grid_programs=plan.num_splits * plan.num_items * h_n,
        programs_in_flight=min(programs, plan.resident_programs),
    )


def gpu_work(plan: GpuPlan, kv_lens, cu_q_lens, num_seqs: int, sliding_window: int | None = None) -> KernelWork:
    """:class:`KernelWork` of one call of the GPU kernel under ``plan`` for concrete lengths (the same arguments
    as ``tpu_plan.tpu_work``); details in :func:`gpu_work_detail`."""
    return gpu_work_detail(plan, kv_lens, cu_q_lens, num_seqs, sliding_window)["work"]
