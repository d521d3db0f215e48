"""The GPU kernel's plan and work model: static tiling, the (sequence, q-block) work lists, each program's KV
range, and what a call moves and issues, all shared with :mod:`pallas_kernels.gpu_ragged_paged_attention`.

**Ranges.** A call is one or two launches (:class:`GpuRange`), each over the sequences whose ``q_len`` falls in
its range. Decode buckets (``T <= 2 S``) have one range with the decode tiling (16-row tiles). Prefill and mixed
buckets have a *prefill* range (``q_len`` above the decode tile's tokens: 64-128-row tiles) and a *decode* range
(the rest: one item per sequence, 16-row tiles, split-KV), so a decode sequence in a mixed step is never
computed over a 128-row prefill tile.

:func:`plan_gpu` (static shapes only) picks each range's ``q_block``, ``pages_per_block``, ``num_splits``,
``num_warps`` and ``num_stages`` from :data:`TUNED_BLOCK_CONFIGS` (keyed by head_dim, page size, dtype; a
heuristic otherwise); the kernel wrapper runs it. :func:`work_list`, :func:`effective_splits` and
:func:`item_kv_range` are written once for ``numpy`` and ``jax.numpy``: the wrapper and kernel run them on
device, :func:`gpu_work` runs them in numpy for host-known lengths and returns
:class:`pallas_kernels.work_model.KernelWork`.

**HBM model** (``kv_bytes_read``): programs are launched in grid order (split fastest, then item, then KV head)
and ``SMs x programs_per_sm`` of them are resident at once (a *wave*). Programs of one wave that read the same
page of one stream (sequence, KV head) share one HBM read through the L2 (50 MB on H200: a wave's streams
advance through their KV together); programs of different waves, or of different launches, do not.
:func:`gpu_work_detail` also reports the bytes gathered into the SMs (no reuse across programs at all) and the
minimum.

:func:`legacy_gpu_work` re-derives the previous GPU design (programs over ``q_block`` flat tokens walking every
sequence with a token in the block, no split-KV) with the same wave model, for before/after tables."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import cdiv
from pallas_kernels.planning import query_lens, sequence_items, visible_kv_blocks
from pallas_kernels.work_model import HARDWARE, KernelWork

MMA_MIN_ROWS = 16  # tl.dot needs M, N, K >= 16
H200_SMS = HARDWARE["h200"].num_cores
SMEM_BYTES_PER_SM = 227 * 1024
MIN_KEYS_PER_SPLIT = 256  # a split shorter than this costs more in partials and launch than it hides
MAX_SPLITS = 32
SMALL_BUCKET_SEQS = 8  # the engine's smallest sequence bucket
GRID_PROGRAMS_PER_SM = 8  # cap on grid programs (most of them empty in a full bucket) per SM


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Tiling of one kind of range: query rows per program, keys per KV step, Triton launch options."""

    rows: int  # target rows of a program's q tile (tokens x padded group), >= 16
    kv_keys: int  # keys per KV step (pages_per_block * page_size)
    num_warps: int
    num_stages: int


# (head_dim, page_size, dtype name) -> (decode config, prefill config). Starting points from the public Triton
# flash-attention / vLLM unified-attention tunings for Hopper, NOT yet measured on our kernel (no GPU has run
# it): decode tiles are the 16-row MMA minimum with long KV steps and 3-4 stage pipelines (bandwidth-bound),
# prefill tiles 64-128 rows with 64-key steps (register-bound accumulators).
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
class GpuRange:
    """One launch of the kernel: the items of the sequences with ``min_q_len < q_len <= max_q_len``."""

    name: str  # "all" (decode buckets), "prefill" or "decode"
    min_q_len: int
    max_q_len: int
    q_block: int  # tokens per work item
    rows: int  # q_block * group_p, >= 16
    pages_per_block: int
    kv_block: int  # keys per KV step
    num_items: int  # static bound on this range's work items
    num_splits: int  # the grid's split axis
    adaptive_splits: bool  # True: the kernel uses effective_splits() of the grid's num_splits
    num_warps: int
    num_stages: int
    programs_per_sm: int  # estimated residency (shared memory bound), for the wave model

    def grid(self, num_kv_heads: int) -> tuple[int, int, int]:
        """``(num_splits, num_items, num_kv_heads)``; the first axis varies fastest in launch order."""
        return (self.num_splits, self.num_items, num_kv_heads)

    @property
    def resident_programs(self) -> int:
        return H200_SMS * self.programs_per_sm


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
    itemsize: int  # of the KV pages (the q tile is cast to it)
    q_itemsize: int
    group: int  # query heads per KV head
    group_p: int  # padded to a power of two
    decode: bool  # a decode bucket (T <= 2 S): one range
    ranges: tuple[GpuRange, ...]  # launched in this order


def _make_range(
    name: str,
    min_q_len: int,
    max_q_len: int,
    cfg: BlockConfig,
    *,
    num_tokens: int,
    max_seqs: int,
    max_blocks: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    itemsize: int,
    group_p: int,
    q_block: int | None,
    pages_per_block: int | None,
    num_splits: int | None,
    num_warps: int | None,
    num_stages: int | None,
    num_sms: int,
) -> GpuRange:
    q_block = q_block or max(1, cfg.rows // group_p)
    q_block = max(1 << (q_block - 1).bit_length(), cdiv(MMA_MIN_ROWS, group_p))
    rows = q_block * group_p
    ppb = pages_per_block or max(1, cfg.kv_keys // page_size)
    ppb = max(1 << (ppb - 1).bit_length(), cdiv(MMA_MIN_ROWS, page_size))
    ppb = min(ppb, max(1 << (max_blocks - 1).bit_length(), cdiv(MMA_MIN_ROWS, page_size)))
    kv_block = ppb * page_size
    # Items: n sequences in the range hold at most n + (T - n) // q_block q-blocks, and each at most
    # cdiv(max_q_len, q_block); n is at most min(S, T // (min_q_len + 1)).
    n_max = max(1, min(max_seqs, num_tokens // (min_q_len + 1)))
    num_items = max(1, min(n_max + (num_tokens - n_max) // q_block, n_max * cdiv(max_q_len, q_block)))
    adaptive = num_splits is None
    if num_splits is None:
        # The grid's split axis is sized for the fewest items the range is likely to hold: one more than half
        # its bound (a smaller batch lands in the previous power-of-two bucket), or a single sequence in a
        # bucket of at most SMALL_BUCKET_SEQS sequences (the smallest bucket holds a lone long-context request
        # as often as a full one), with the grid kept under GRID_PROGRAMS_PER_SM x SMs programs. The kernel
        # then uses only the splits the real item count needs (effective_splits); the other programs stop
        # after their scalar loads.
        likely = 1 if n_max <= SMALL_BUCKET_SEQS else num_items // 2 + 1
        base = likely * num_kv_heads
        num_splits = 1
        if base < 2 * num_sms:
            most = max(
                1,
                min(
                    MAX_SPLITS,
                    max_blocks * page_size // MIN_KEYS_PER_SPLIT,
                    cdiv(GRID_PROGRAMS_PER_SM * num_sms, num_items * num_kv_heads),
                ),
            )
            num_splits = max(1, min(cdiv(2 * num_sms, base), most))
    num_stages = num_stages or cfg.num_stages
    smem = num_stages * kv_block * head_dim * 2 * itemsize + rows * head_dim * itemsize
    return GpuRange(
        name=name,
        min_q_len=min_q_len,
        max_q_len=max_q_len,
        q_block=q_block,
        rows=rows,
        pages_per_block=ppb,
        kv_block=kv_block,
        num_items=num_items,
        num_splits=num_splits,
        adaptive_splits=adaptive and num_splits > 1,
        num_warps=num_warps or cfg.num_warps,
        num_stages=num_stages,
        programs_per_sm=max(1, min(4, SMEM_BYTES_PER_SM // smem)),
    )


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
    decode_q_block: int | None = None,
    decode_num_splits: int | None = None,
    one_range: bool = False,
    num_sms: int = H200_SMS,
) -> GpuPlan:
    """The kernel's static plan for a bucket. Overrides (tests, tuning) are rounded up to the MMA minimums:
    ``q_block, pages_per_block, num_splits, num_warps, num_stages`` set the first range (the only one of a
    decode bucket, the prefill range otherwise), ``decode_q_block, decode_num_splits`` the decode range of a
    prefill bucket; ``one_range`` keeps a prefill bucket in one range (the prefill tiling for every item)."""
    group = num_q_heads // num_kv_heads
    group_p = 1 << (group - 1).bit_length()
    decode = num_tokens <= 2 * max_seqs
    itemsize = jnp.dtype(dtype).itemsize
    cfg_decode, cfg_prefill = block_configs(head_dim, page_size, dtype)
    common = dict(
        num_tokens=num_tokens,
        max_seqs=max_seqs,
        max_blocks=max_blocks,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        itemsize=itemsize,
        group_p=group_p,
        num_sms=num_sms,
        pages_per_block=pages_per_block,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if decode or one_range:
        ranges = (
            _make_range(
                "all",
                0,
                num_tokens,
                cfg_decode if decode else cfg_prefill,
                q_block=q_block,
                num_splits=num_splits,
                **common,
            ),
        )
    else:
        dec = _make_range(
            "decode", 0, num_tokens, cfg_decode, q_block=decode_q_block, num_splits=decode_num_splits, **common
        )
        dec = _make_range(
            "decode", 0, dec.q_block, cfg_decode, q_block=dec.q_block, num_splits=decode_num_splits, **common
        )  # one item per sequence
        pre = _make_range(
            "prefill", dec.q_block, num_tokens, cfg_prefill, q_block=q_block, num_splits=num_splits, **common
        )
        ranges = (pre, dec)
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
        decode=decode,
        ranges=ranges,
    )


def gpu_plan_for(q_shape, kv_pages_shape, max_seqs: int, max_blocks: int, dtype, q_dtype=None, **overrides) -> GpuPlan:
    """The kernel's static plan for one call's shapes (what :func:`ragged_paged_attention_gpu` uses);
    ``overrides`` as :func:`plan_gpu` takes them."""
    num_tokens, num_q_heads, head_dim = q_shape
    _, num_kv_heads, page_size, _ = kv_pages_shape
    return plan_gpu(
        num_tokens, max_seqs, max_blocks, num_q_heads, num_kv_heads, head_dim, page_size, dtype, q_dtype, **overrides
    )


def work_list(
    xp, cu_q_lens, kv_lens, num_seqs, *, q_block: int, num_items: int, min_q_len: int = 0, max_q_len: int | None = None
):
    """The ``(sequence, q-block)`` items of the sequences with ``min_q_len < q_len <= max_q_len``, in sequence
    order; ``xp`` is ``numpy`` or ``jax.numpy``.

    Returns int32 arrays of length ``num_items``: ``seq`` (owner), ``tok0`` (flat index of its first token),
    ``n`` (its tokens, 0 for an empty item past the real ones), ``pos0`` (position of its first token),
    ``kv_len`` (the owner's keys). The kernel wrapper and the work model both call this."""
    i32 = lambda x: xp.asarray(x).astype(xp.int32)
    q_lens = query_lens(xp, cu_q_lens, num_seqs)
    member = (q_lens > min_q_len) if max_q_len is None else (q_lens > min_q_len) & (q_lens <= max_q_len)
    seq, k, real = sequence_items(xp, xp.where(member, cdiv(q_lens, q_block), 0), num_items)
    off = k * q_block
    n = xp.where(real, xp.clip(q_lens[seq] - off, 0, q_block), 0)
    tok0 = cu_q_lens[seq] + off
    pos0 = kv_lens[seq] - q_lens[seq] + off
    return i32(seq), i32(tok0), i32(n), i32(pos0), i32(kv_lens[seq])


def range_work_list(xp, rng: GpuRange, cu_q_lens, kv_lens, num_seqs):
    """:func:`work_list` of one range."""
    return work_list(
        xp,
        cu_q_lens,
        kv_lens,
        num_seqs,
        q_block=rng.q_block,
        num_items=rng.num_items,
        min_q_len=rng.min_q_len,
        max_q_len=rng.max_q_len,
    )


COMBINE_VALUES_PER_THREAD = 32  # f32 values of the running and the loaded partial each, per thread


def combine_num_warps(rng: GpuRange, head_dim: int) -> int:
    """Warps of the split-KV combine of one range: enough that its ``[rows, head_dim]`` f32 accumulator and the
    partial it loads fit in registers (a prefill combine of 128 x 128 on 4 warps, and of 64 x 256 on 8, spilled)."""
    warps = 4
    while warps < 16 and rng.rows * head_dim > COMBINE_VALUES_PER_THREAD * 32 * warps:
        warps *= 2
    return warps


def effective_splits(xp, real_items, *, num_splits: int, num_kv_heads: int, num_sms: int = H200_SMS):
    """Splits the call actually uses, at most the grid's ``num_splits``: enough that real items x KV heads x
    splits reaches twice the SM count. A device scalar in the wrapper, an int in the work model."""
    want = (2 * num_sms + real_items * num_kv_heads - 1) // xp.maximum(real_items * num_kv_heads, 1)
    return xp.clip(want, 1, num_splits)


def _item_blocks(xp, pos0, n, *, num_splits, kv_block: int, sliding_window: int | None):
    first_key, lo, hi = visible_kv_blocks(pos0, n, kv_block, sliding_window)
    first_key = first_key + xp.zeros_like(pos0)  # like pos0 with or without a window
    last = pos0 + n - 1
    hi = xp.where(n > 0, hi, lo)
    per = (hi - lo + num_splits - 1) // num_splits  # KV blocks per split
    return first_key, last, lo, hi, per


def item_splits_with_work(xp, pos0, n, *, num_splits, kv_block: int, sliding_window: int | None):
    """How many of an item's splits walk at least one KV block: always a prefix ``[0, k)`` of the splits (the
    combine reads only those)."""
    _, _, lo, hi, per = _item_blocks(
        xp, pos0, n, num_splits=num_splits, kv_block=kv_block, sliding_window=sliding_window
    )
    return (hi - lo + per - 1) // xp.maximum(per, 1)


def item_kv_range(
    xp, pos0, n, *, split, num_splits, kv_block: int, page_size: int, max_blocks: int, sliding_window: int | None
):
    """KV blocks ``[b_lo, b_hi)`` one program (item, split) walks, and the item's visible pages
    ``[p_lo, p_hi]`` (clamped to the table; every gather index is clamped into it). Scalars in the kernel,
    arrays in the work model."""
    first_key, last, lo, hi, per = _item_blocks(
        xp, pos0, n, num_splits=num_splits, kv_block=kv_block, sliding_window=sliding_window
    )
    b_lo = xp.minimum(lo + split * per, hi)
    b_hi = xp.minimum(b_lo + per, hi)
    p_lo = xp.minimum(first_key // page_size, max_blocks - 1)
    p_hi = xp.clip(last // page_size, p_lo, max_blocks - 1)
    return b_lo, b_hi, p_lo, p_hi


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
    page_bytes = page * d * 2 * plan.itemsize  # K and V of one KV head
    q_tok_bytes = plan.num_q_heads * d * plan.q_itemsize
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
