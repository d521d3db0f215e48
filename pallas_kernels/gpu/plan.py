"""The GPU kernel's plan: static tiling and the (sequence, q-block) work lists and KV ranges its programs walk,
shared with :mod:`pallas_kernels.gpu.ragged_paged_attention` (which runs it) and
:mod:`pallas_kernels.gpu.work_model` (which counts what it moves and issues).

**Ranges.** A call is one or two launches (:class:`GpuRange`), each over the sequences whose ``q_len`` falls in
its range. Decode buckets (``T <= 2 S``) have one range with the decode tiling (16-row tiles). Prefill and mixed
buckets have a *prefill* range (``q_len`` above the decode tile's tokens: 64-128-row tiles) and a *decode* range
(the rest: one item per sequence, 16-row tiles, split-KV), so a decode sequence in a mixed step is never
computed over a 128-row prefill tile.

:func:`plan_gpu` (static shapes only) picks each range's ``q_block``, ``pages_per_block``, ``num_splits``,
``num_warps`` and ``num_stages`` from :mod:`pallas_kernels.gpu.tuned_block_sizes`; the kernel wrapper runs it.
:func:`work_list`, :func:`effective_splits` and :func:`item_kv_range` are written once for ``numpy`` and
``jax.numpy``: the wrapper and kernel run them on device, the work model in numpy for host-known lengths."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from pallas_kernels import kv_quant
from pallas_kernels.common import cdiv
from pallas_kernels.gpu.tuned_block_sizes import BlockConfig, block_configs
from pallas_kernels.planning import query_lens, sequence_items, visible_kv_blocks
from pallas_kernels.work_model import HARDWARE

MMA_MIN_ROWS = 16  # tl.dot needs M, N, K >= 16
H200_SMS = HARDWARE["h200"].num_cores
SMEM_BYTES_PER_SM = 227 * 1024
MIN_KEYS_PER_SPLIT = 256  # a split shorter than this costs more in partials and launch than it hides
MAX_SPLITS = 32
SMALL_BUCKET_SEQS = 8  # the engine's smallest sequence bucket
GRID_PROGRAMS_PER_SM = 8  # cap on grid programs (most of them empty in a full bucket) per SM


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
    f32_dots: bool = False  # the dots run on float32 operands (float32 pages, or float32 queries over quantized)


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
    # Quantized values are cast to the query's dtype in registers, so float32 queries over int8/fp8 pages hold
    # float32 K and V tiles: tiled as float32 pages are (the KV bytes still size shared memory).
    quantized_f32 = kv_quant.is_quantized_dtype(dtype) and q_dtype is not None and jnp.dtype(q_dtype) == jnp.float32
    f32_dots = quantized_f32 or jnp.dtype(dtype) == jnp.float32
    cfg_decode, cfg_prefill = block_configs(head_dim, page_size, jnp.float32 if quantized_f32 else dtype)
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
    ranges: tuple[GpuRange, ...]
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
        f32_dots=f32_dots,
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
