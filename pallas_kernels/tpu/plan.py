"""How the TPU kernel divides a call into work items, and what that plan moves and computes.

The kernel (:mod:`pallas_kernels.tpu.ragged_paged_attention`) runs in two ranges, each one ``pallas_call`` with static
block
sizes:

- **decode**: one item per sequence with exactly one query token. Its rows are the ``group`` query heads of a
  KV head (``[group, head_dim]``, padded by the MXU to the 8-row sublane tile), so it computes only rows it
  uses.
- **prefill** (chunked prefill and prefill, any ``q_len >= 2``): a sequence's queries are cut into items of
  ``tokens_per_item`` consecutive tokens (128-512 when the bucket is long, so a chunk's KV is streamed a few
  times, not 16-32), and an item never holds tokens of two sequences.

An item walks the KV blocks (``pages_per_block`` pages) its rows can see, from the first one inside the
sliding window to the one holding its last query position; pages past ``kv_len`` are never copied.

Everything here is generic over ``numpy``/``jax.numpy`` (``xp``): the kernel wrapper builds its item list with
:func:`plan_items` under ``jit``, and :func:`tpu_work` runs the *same* function on concrete lengths to count
pages, blocks and matmul rows, so the work model cannot drift from the kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from pallas_kernels.common import cdiv
from pallas_kernels.planning import query_lens, sequence_items, visible_kv_blocks
from pallas_kernels.work_model import KernelWork

_SUBLANES = 8  # MXU row granularity: rows are padded to the 8-sublane tile
_LANES = 128
# VMEM the kernel may plan for (the scoped limit is raised to fit; v5e/v6e have 128 MiB, v7x 64 MiB).
_VMEM_BUDGET = 36 * 2**20


@dataclasses.dataclass(frozen=True)
class RangePlan:
    """Static tiling of one range (decode or prefill)."""

    tokens_per_item: int  # query tokens of one sequence per item (1 for decode)
    pages_per_block: int  # pages per DMA'd KV block
    num_items: int  # grid size: a static bound on the items of this range


@dataclasses.dataclass(frozen=True)
class TpuPlan:
    num_tokens: int
    max_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    itemsize: int  # of the pages (the queries too, for float pages)
    decode: RangePlan
    prefill: RangePlan
    q_itemsize: int = 0  # of the queries over quantized pages (0: itemsize)
    scale_width: int = 0  # lanes of one page's scale row (kv_quant.scale_row_width, lane-dense); 0: float pages

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


class Items(NamedTuple):
    """One range's work list; arrays of ``[num_items]`` int32. Real items first, then ``n == 0`` padding."""

    seq: Any  # sequence of the item (numpy or jax arrays: plan_items' `xp`)
    t0: Any  # first flat query token of the item
    n: Any  # real query tokens of the item (0: padding item)


def vmem_bytes(plan: TpuPlan, rng: RangePlan) -> int:
    """VMEM one grid step of ``rng`` holds, with Mosaic's tile padding (128 lanes; 8 sublanes for 32-bit,
    16 for bfloat16): q/out double buffers, the KV double buffer, softmax state, and the f32 temporaries of
    one head's block (logits, probabilities, mask and their copies). Quantized pages add the scale rows' double
    buffer and the temporaries that turn them into per-key rows: ``[kv_block, scale_width]`` each (the rows
    broadcast to keys, two iotas, the diagonal mask, the diagonal in f32 and its three bf16 parts) and the
    ``[2 kv_heads, kv_block]`` f32 results, which grow with KV heads x page size x pages per block."""
    lanes = lambda x: cdiv(x, _LANES) * _LANES
    sub = lambda x, it: cdiv(x, 32 // it) * (32 // it)
    w, it = rng.tokens_per_item, plan.itemsize
    q_it = plan.q_itemsize or it
    rows = sub(plan.group * w, 4)
    kv_block = rng.pages_per_block * plan.page_size
    total = (
        4 * w * sub(plan.num_q_heads, q_it) * lanes(plan.head_dim) * q_it  # q and out, two slots each
        + 2 * plan.num_kv_heads * kv_block * lanes(2 * plan.head_dim) * it  # KV, two slots
        + plan.num_kv_heads * rows * (2 * _LANES + lanes(plan.head_dim)) * 4  # m, l (lane-replicated), acc
        + 6 * rows * lanes(kv_block) * 4  # one head's logits, probabilities, mask and temporaries
    )
    if plan.scale_width:
        width = lanes(plan.scale_width)
        total += 2 * sub(rng.pages_per_block, 4) * width * 4  # the scale rows, two slots
        total += kv_block * width * (5 * 4 + 3 * 2)  # per-key rows, iotas, mask, diagonal (f32) + bf16 parts
        total += 4 * sub(max(8, 2 * plan.num_kv_heads), 4) * lanes(kv_block) * 4  # three products and their sum
    return total


def plan_tpu(
    num_tokens: int,
    max_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    itemsize: int,
    max_blocks: int,
    block_sizes: tuple[int, int, int],
    tokens_per_item: int | None = None,
    pages_per_block: int | None = None,
    q_itemsize: int = 0,
    scale_width: int = 0,
) -> TpuPlan:
    """The static plan of one bucket. ``block_sizes`` = (decode KV slots, prefill tokens, prefill KV slots)
    from :mod:`pallas_kernels.tpu.tuned_block_sizes`; ``tokens_per_item``/``pages_per_block`` override the prefill range
    (tests force small blocks so sequences span several items and blocks)."""
    dec_slots, pre_tokens, pre_slots = block_sizes
    pages = lambda slots: max(1, min(max(1, slots // page_size), max_blocks))
    dec_ppb = pages_per_block or pages(dec_slots)
    w = tokens_per_item or min(pre_tokens, max(16, 1 << (max(num_tokens, 2) - 1).bit_length()))
    if w & (w - 1) or w < 2:
        raise ValueError(f"tokens_per_item must be a power of two >= 2, got {w}")
    pre_ppb = pages_per_block or pages(pre_slots)
    decode = RangePlan(1, dec_ppb, min(max_seqs, num_tokens))
    prefill = _prefill_range(num_tokens, max_seqs, w, pre_ppb)
    plan = TpuPlan(
        num_tokens,
        max_seqs,
        num_q_heads,
        num_kv_heads,
        head_dim,
        page_size,
        itemsize,
        decode,
        prefill,
        q_itemsize,
        scale_width,
    )
    over = lambda rng: vmem_bytes(plan, rng) > _VMEM_BUDGET
    if pages_per_block is None and scale_width:
        # Quantized pages: the scale temporaries grow with the KV block (x KV heads x page size), so wide models
        # at large pages take fewer pages per block, in both ranges, before the prefill item shrinks.
        while plan.decode.pages_per_block > 1 and over(plan.decode):
            plan = dataclasses.replace(
                plan, decode=dataclasses.replace(plan.decode, pages_per_block=plan.decode.pages_per_block // 2)
            )
        while plan.prefill.pages_per_block > 1 and over(plan.prefill):
            plan = dataclasses.replace(
                plan, prefill=dataclasses.replace(plan.prefill, pages_per_block=plan.prefill.pages_per_block // 2)
            )
    if tokens_per_item is None:  # shrink the prefill item until one step fits the VMEM budget
        while plan.prefill.tokens_per_item > 16 and over(plan.prefill):
            smaller = _prefill_range(
                num_tokens, max_seqs, plan.prefill.tokens_per_item // 2, plan.prefill.pages_per_block
            )
            plan = dataclasses.replace(plan, prefill=smaller)
    return plan


def _prefill_range(num_tokens: int, max_seqs: int, w: int, pages_per_block: int) -> RangePlan:
    """Grid bound: sum over sequences with q_len >= 2 of cdiv(q_len, w) <= num_tokens / w + their count, and
    for w >= 4 also <= num_tokens / 2 (each such item then holds at least two tokens on average)."""
    many = cdiv(num_tokens, w) + min(max_seqs, num_tokens // 2)
    return RangePlan(w, pages_per_block, max(1, min(many, num_tokens // 2 if w >= 4 else num_tokens)))


def plan_items(xp, cu_q_lens, num_seqs, rng: RangePlan, decode: bool) -> Items:
    """The work list of one range from the batch metadata (``cu_q_lens [max_seqs + 1]``, ``num_seqs`` scalar).

    Decode items are the sequences with one query token, in order; prefill items cut every sequence with two
    or more query tokens into ``tokens_per_item`` windows. Generic over ``xp`` (numpy or jax.numpy)."""
    q_lens = query_lens(xp, cu_q_lens, num_seqs)
    w = rng.tokens_per_item
    if decode:
        counts = (q_lens == 1).astype(np.int32)
    else:
        counts = xp.where(q_lens >= 2, cdiv(q_lens, w), 0).astype(np.int32)
    seq, k, real = sequence_items(xp, counts, rng.num_items)
    t0 = xp.where(real, cu_q_lens[seq] + k * w, 0).astype(np.int32)
    n = xp.where(real, xp.minimum(w, q_lens[seq] - k * w), 0).astype(np.int32)
    return Items(xp.where(real, seq, 0).astype(np.int32), t0, n)


def item_blocks(kv_len, q_len, q_start, t0, n, kv_block: int, sliding_window: int | None):
    """``(first_pos, b_lo, b_hi)``: the item's first query position and its visible KV blocks ``[b_lo, b_hi)``.

    Works on scalars of any array library (the kernel calls it on SMEM scalars)."""
    first_pos = kv_len - q_len + (t0 - q_start)
    _, b_lo, b_hi = visible_kv_blocks(first_pos, n, kv_block, sliding_window)
    return first_pos, b_lo, b_hi


def masked_block(b, first_pos, n, kv_block: int, sliding_window: int | None):
    """Whether KV block ``b`` of an item (``n`` queries from position ``first_pos``) needs masks: some row sees
    only part of it (its last key is past the first query position, or, with a window, its first key is
    outside the last query's window). Other blocks are computed unmasked. Works on scalars of any array
    library (the kernel calls it on SMEM scalars)."""
    partial = (b + 1) * kv_block - 1 > first_pos
    if sliding_window is not None:
        partial |= b * kv_block <= first_pos + n - 1 - sliding_window
    return partial


def item_counts(
    plan: TpuPlan,
    kv_lens,
    cu_q_lens,
    num_seqs: int,
    sliding_window: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per range (decode, prefill): ``[num_items, 3]`` pages DMA'd, KV blocks computed and KV blocks computed
    with masks (:func:`masked_block`) by each item, as the kernel's own ``stats`` output reports them."""
    kv_lens, cu = np.asarray(kv_lens, np.int64), np.asarray(cu_q_lens, np.int64)
    out = []
    for rng, decode in ((plan.decode, True), (plan.prefill, False)):
        kv_block = rng.pages_per_block * plan.page_size
        counts = np.zeros((rng.num_items, 3), np.int64)
        for j, (s, t0, n) in enumerate(zip(*plan_items(np, cu, num_seqs, rng, decode), strict=True)):
            if n == 0:
                continue
            kv_len, q_len = int(kv_lens[s]), int(cu[s + 1] - cu[s])
            pos, b_lo, b_hi = item_blocks(kv_len, q_len, int(cu[s]), int(t0), int(n), kv_block, sliding_window)
            n_pages = cdiv(kv_len, plan.page_size)
            ppb = rng.pages_per_block
            counts[j, 0] = sum(max(0, min(ppb, n_pages - b * ppb)) for b in range(b_lo, b_hi))
            counts[j, 1] = b_hi - b_lo
            counts[j, 2] = sum(masked_block(b, pos, int(n), kv_block, sliding_window) for b in range(b_lo, b_hi))
        out.append(counts)
    return out[0], out[1]


def tpu_work(plan: TpuPlan, kv_lens, cu_q_lens, num_seqs: int, sliding_window: int | None = None) -> KernelWork:
    """What one call moves and issues under ``plan`` for concrete lengths, from the kernel's own item lists.

    KV bytes count every page the kernel DMAs (whole pages, none past ``kv_len``); issued FLOPs count the
    ``2 * rows * keys * head_dim`` of QK^T and of PV for every (item, KV head, block), rows padded to 8;
    useful FLOPs count the visible (query, key) pairs only."""
    d, hkv = plan.head_dim, plan.num_kv_heads
    page_bytes = hkv * plan.page_size * 2 * d * plan.itemsize
    pages = issued = exps = programs = 0
    for rng, counts in zip(
        (plan.decode, plan.prefill), item_counts(plan, kv_lens, cu_q_lens, num_seqs, sliding_window), strict=True
    ):
        kv_block = rng.pages_per_block * plan.page_size
        rows = cdiv(plan.group * rng.tokens_per_item, _SUBLANES) * _SUBLANES
        blocks = int(counts[:, 1].sum())
        pages += int(counts[:, 0].sum())
        programs += int((counts[:, 1] > 0).sum())
        issued += blocks * hkv * 2 * (2 * rows * kv_block * d)
        exps += blocks * hkv * rows * kv_block
    cu = np.asarray(cu_q_lens, np.int64)
    useful = useful_flops(plan.num_q_heads, d, kv_lens, cu, num_seqs, sliding_window)
    q_bytes = int(cu[num_seqs]) * plan.num_q_heads * d * plan.itemsize
    return KernelWork(pages * page_bytes, q_bytes, q_bytes, issued, useful, exps, programs)


def static_work(plan: TpuPlan, rng: RangePlan, max_blocks: int, num_pages: int) -> KernelWork:
    """The most one range's call can do, from shapes alone (lengths are traced): every item sees
    ``max_blocks`` pages, but no more pages than the cache holds are read. This is the ``cost_estimate``
    handed to XLA, which only schedules around it."""
    page_bytes = plan.num_kv_heads * plan.page_size * 2 * plan.head_dim * plan.itemsize
    pages = min(rng.num_items * max_blocks, num_pages)
    blocks = rng.num_items * cdiv(max_blocks, rng.pages_per_block)
    kv_block = rng.pages_per_block * plan.page_size
    rows = cdiv(plan.group * rng.tokens_per_item, _SUBLANES) * _SUBLANES
    issued = blocks * plan.num_kv_heads * 4 * rows * kv_block * plan.head_dim
    q_bytes = min(plan.num_tokens, rng.num_items * rng.tokens_per_item) * plan.num_q_heads * plan.head_dim
    q_bytes *= plan.itemsize
    exps = blocks * plan.num_kv_heads * rows * kv_block
    return KernelWork(pages * page_bytes, q_bytes, q_bytes, issued, 0, exps, rng.num_items)


def useful_flops(num_q_heads: int, head_dim: int, kv_lens, cu_q_lens, num_seqs: int, sliding_window: int | None) -> int:
    """``4 * head_dim * num_q_heads`` per visible (query, key) pair: QK^T and PV, nothing padded."""
    pairs = 0
    for s in range(num_seqs):
        q_len, kv_len = int(cu_q_lens[s + 1] - cu_q_lens[s]), int(kv_lens[s])
        pos = np.arange(kv_len - q_len, kv_len)
        lo = 0 if sliding_window is None else np.maximum(pos - sliding_window + 1, 0)
        pairs += int(np.sum(pos + 1 - lo))
    return 4 * head_dim * num_q_heads * pairs
