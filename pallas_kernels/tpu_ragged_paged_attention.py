"""Ragged paged attention for TPU (Pallas/Mosaic): decode, chunked prefill and prefill in one kernel.

Layout and masking conventions: :mod:`pallas_kernels.common`.

Grid and data movement. The grid walks blocks of ``q_block`` consecutive flat query tokens (the query block is
an ordinary pipelined ``BlockSpec``; the queries are laid out ``[kv_head, group, token, head_dim]`` so that
the query heads sharing a KV head form one ``[group * q_block, head_dim]`` matrix). A query block may hold
tokens of several sequences; the wrapper computes which (``first_seq``/``last_seq`` per block) and passes
them, the block table, ``kv_lens`` and ``cu_q_lens`` by scalar prefetch (SMEM). Inside a grid step one
``while`` loop walks the (sequence, KV block) pairs the block needs; a KV block is ``pages_per_block`` pages,
each DMA'd from HBM (``memory_space=ANY``) as one contiguous ``page_size * 2 * num_kv_heads * head_dim`` slab
(two 128-lane halves for head_dim 256: Mosaic's strided loads want 128-lane rows) into a double buffer in
VMEM, the next block's DMAs in flight while the current one is computed (the first block of each grid step is
not overlapped). Pages past ``kv_len`` are not copied, and KV blocks entirely before a sliding window or after
the last query position are skipped.

Compute. For each KV head the K and V rows are strided loads out of the interleaved buffer (for bfloat16 the
K/V pair of a head shares one 32-bit word, split with shifts), so the pages of a KV head are read from HBM
once for all its query heads. An online softmax in float32 scratch (``m``, ``l`` lane-replicated, ``acc``)
folds in each block; rows of other sequences in the query block see only masked logits and stay unchanged. The
mask value is finite, probabilities of masked keys are exactly zero, and V rows past ``kv_len`` are zeroed
(stale VMEM or a poisoned slot may hold NaN), so padding rows come out as zeros.

Each grid step is self-contained (its DMAs start and finish inside it), so the query-block axis is
``parallel`` and splits across TensorCores on megacore chips. Block tables live in SMEM, which bounds
``max_seqs * max_blocks_per_seq`` (as in JAX's own ragged paged-attention kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import MASK_VALUE, apply_soft_cap, validate_kernel_shape
from pallas_kernels.tpu_tuned_block_sizes import get_block_sizes

_LANES = 128
# Split bfloat16 K/V rows with 32-bit strided loads and shifts (see ``load_kv``). The TPU interpreter cannot
# bitcast refs, so interpret mode takes plain bfloat16 strided loads, which return the same values.
_PACKED_BF16_LOADS = True


def _kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref,  # [max_seqs] int32
    tables_ref,  # [max_seqs * max_blocks] int32, flattened block table
    cu_q_lens_ref,  # [max_seqs + 1] int32
    first_seq_ref,  # [num_q_blocks] int32, first sequence with a token in the query block
    last_seq_ref,  # [num_q_blocks] int32, last one (< first when the block is all padding)
    # Inputs.
    q_ref,  # [num_kv_heads, group, q_block, head_dim] (VMEM block)
    kv_hbm_ref,  # [num_pages, page_size * 2 * num_kv_heads, head_dim] (HBM)
    # Outputs.
    o_ref,  # [num_kv_heads, group, q_block, head_dim]
    # Scratch.
    kv_buf,  # [2, lane_chunks, pages_per_block * page_size * 2 * num_kv_heads, chunk]
    sems,  # DMA semaphores [2]
    m_ref,  # [num_kv_heads, group * q_block, 128] f32, running max (lane-replicated)
    l_ref,  # [num_kv_heads, group * q_block, 128] f32, running denominator
    acc_ref,  # [num_kv_heads, group * q_block, head_dim] f32
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    page_size: int,
    pages_per_block: int,
    max_blocks: int,
    packed_bf16: bool,
):
    num_kv_heads, group, q_block, head_dim = q_ref.shape
    lane_chunks, chunk = kv_buf.shape[1], kv_buf.shape[3]
    rows = group * q_block
    kv_block = pages_per_block * page_size
    page_rows = page_size * 2 * num_kv_heads
    blk = pl.program_id(0)
    blk_start = blk * q_block
    blk_end = blk_start + q_block

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def seq_info(s):
        """Rows of sequence ``s`` in this block, its lengths, and the KV block range those rows can see."""
        s = jnp.clip(s, 0, kv_lens_ref.shape[0] - 1)
        q_start, q_end, kv_len = cu_q_lens_ref[s], cu_q_lens_ref[s + 1], kv_lens_ref[s]
        lo, hi = jnp.maximum(q_start, blk_start), jnp.minimum(q_end, blk_end)
        first_pos = kv_len - (q_end - q_start) + (lo - q_start)  # position of the first row in the block
        last_pos = first_pos + (hi - lo) - 1
        first_key = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
        b_lo = first_key // kv_block
        b_hi = jnp.where(hi > lo, last_pos // kv_block + 1, b_lo)  # empty range when no rows
        return q_start, q_end, kv_len, b_lo, b_hi

    def next_nonempty(s, last):
        def cond(s):
            _, _, _, b_lo, b_hi = seq_info(s)
            return (s <= last) & (b_lo >= b_hi)

        return jax.lax.while_loop(cond, lambda s: s + 1, s)

    def dma(s, b, slot, kv_len):
        """Page copies of KV block ``b`` of sequence ``s`` into buffer ``slot`` (none past kv_len)."""
        n_pages = cdiv_i32(kv_len, page_size)
        copies = []
        for i in range(pages_per_block):
            idx = b * pages_per_block + i
            page = tables_ref[s * max_blocks + jnp.minimum(idx, max_blocks - 1)]
            for c in range(lane_chunks):
                copy = pltpu.make_async_copy(
                    kv_hbm_ref.at[page, :, pl.ds(c * chunk, chunk)],
                    kv_buf.at[slot, c, pl.ds(i * page_rows, page_rows), :],
                    sems.at[slot],
                )
                copies.append((idx < n_pages, copy))
        return copies

    def start(copies):
        for needed, copy in copies:
            pl.when(needed)(copy.start)

    def wait(copies):
        for needed, copy in copies:
            pl.when(needed)(copy.wait)

    def load_kv(slot, h, c):
        """Lanes ``c * chunk:(c + 1) * chunk`` of K and V of KV head ``h``, each ``[kv_block, chunk]``."""
        if kv_buf.dtype == jnp.float32 or not packed_bf16:
            k = kv_buf[slot, c, pl.ds(2 * h, kv_block, stride=2 * num_kv_heads), :]
            v = kv_buf[slot, c, pl.ds(2 * h + 1, kv_block, stride=2 * num_kv_heads), :]
            return k, v
        # bfloat16: rows 2h (K) and 2h + 1 (V) share one 32-bit word; K is the low half.
        words = kv_buf.bitcast(jnp.uint32)[slot, c, pl.ds(h, kv_block, stride=num_kv_heads), :]
        k = pltpu.bitcast(words << 16, jnp.float32).astype(jnp.bfloat16)
        v = pltpu.bitcast(words & jnp.uint32(0xFFFF0000), jnp.float32).astype(jnp.bfloat16)
        return k, v

    def compute(s, b, slot):
        q_start, q_end, kv_len, _, _ = seq_info(s)
        q_len = q_end - q_start
        tok = blk_start + jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, (rows, kv_block), 0), q_block)
        k_pos = b * kv_block + jax.lax.broadcasted_iota(jnp.int32, (rows, kv_block), 1)
        q_pos = kv_len - q_len + (tok - q_start)
        mask = (tok >= q_start) & (tok < q_end) & (k_pos <= q_pos)
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        v_ok = b * kv_block + jax.lax.broadcasted_iota(jnp.int32, (kv_block, chunk), 0) < kv_len
        for h in range(num_kv_heads):
            q = q_ref[h].reshape(rows, head_dim)
            kv = [load_kv(slot, h, c) for c in range(lane_chunks)]
            logits = sum(
                jax.lax.dot_general(
                    q[:, c * chunk : (c + 1) * chunk],
                    k,
                    (((1,), (1,)), ((), ())),
                    preferred_element_type=jnp.float32,
                )
                for c, (k, _) in enumerate(kv)
            )
            logits = apply_soft_cap(logits * sm_scale, soft_cap)
            logits = jnp.where(mask, logits, MASK_VALUE)
            m_prev, l_prev = m_ref[h], l_ref[h]  # [rows, 128]
            m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.where(mask, jnp.exp(logits - m_next[:, :1]), 0.0)
            l_ref[h] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            m_ref[h] = m_next
            for c, (_, v) in enumerate(kv):
                v = jnp.where(v_ok, v, jnp.zeros_like(v))
                pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
                lanes = pl.ds(c * chunk, chunk)
                acc_ref[h, :, lanes] = alpha[:, :1] * acc_ref[h, :, lanes] + pv

    first, last = first_seq_ref[blk], last_seq_ref[blk]
    s0 = next_nonempty(first, last)

    @pl.when(s0 <= last)
    def _():
        _, _, kv_len, b_lo, _ = seq_info(s0)
        start(dma(s0, b_lo, 0, kv_len))

    def body(state):
        s, b, slot = state
        _, _, kv_len, _, b_hi = seq_info(s)
        more_here = b + 1 < b_hi
        ns = jnp.where(more_here, s, next_nonempty(s + 1, last))
        ns_c = jnp.minimum(ns, last)
        _, _, nkv_len, nb_lo, _ = seq_info(ns_c)
        nb = jnp.where(more_here, b + 1, nb_lo)

        @pl.when(ns <= last)
        def _():
            start(dma(ns_c, nb, 1 - slot, nkv_len))

        wait(dma(s, b, slot, kv_len))
        compute(s, b, slot)
        return ns, nb, 1 - slot

    _, _, _, b0, _ = seq_info(jnp.minimum(s0, last))
    jax.lax.while_loop(lambda st: st[0] <= last, body, (s0, b0, jnp.int32(0)))

    den = l_ref[...][:, :, :1]
    out = jnp.where(den > 0, acc_ref[...] / jnp.where(den > 0, den, 1.0), 0.0)
    o_ref[...] = out.reshape(o_ref.shape).astype(o_ref.dtype)


def cdiv_i32(a, b: int):
    return (a + b - 1) // b


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "interpret",
        "q_block",
        "pages_per_block",
        "generation",
    ),
)
def ragged_paged_attention_tpu(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: jax.Array,  # [max_seqs] int32
    block_tables: jax.Array,  # [max_seqs, max_blocks_per_seq] int32
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    q_block: int | None = None,
    pages_per_block: int | None = None,
    generation: str | None = None,
) -> jax.Array:
    """Ragged paged attention on TPU; returns ``[num_tokens, num_q_heads, head_dim]`` in ``q.dtype``.

    ``q_block`` (query tokens per grid step) and ``pages_per_block`` (pages per DMA'd KV block) default to the
    table in :mod:`.tpu_tuned_block_sizes` for ``generation`` (by default the local TPU's, else a heuristic).
    ``interpret``: True or a ``pltpu.InterpretParams`` runs the kernel in the TPU interpreter (CPU is fine).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads_x2, _ = kv_pages.shape
    num_kv_heads = kv_heads_x2 // 2
    group = num_q_heads // num_kv_heads
    max_seqs, max_blocks = block_tables.shape
    validate_kernel_shape(head_dim, page_size)
    tuned_q, tuned_pages = get_block_sizes(
        num_tokens, page_size, num_kv_heads, head_dim, kv_pages.dtype, max_blocks, generation
    )
    q_block = q_block or tuned_q
    pages_per_block = pages_per_block or tuned_pages
    if num_tokens % q_block or q_block % 16:
        raise ValueError(f"q_block ({q_block}) must be a multiple of 16 dividing num_tokens ({num_tokens})")
    num_q_blocks = num_tokens // q_block
    out_dtype = q.dtype
    q = q.astype(kv_pages.dtype)
    if interpret is True:
        interpret = pltpu.InterpretParams()

    # Which sequences each query block touches (first > last: all padding).
    total = cu_q_lens[num_seqs[0]]
    starts = jnp.arange(num_q_blocks, dtype=jnp.int32) * q_block
    ends = jnp.minimum(starts + q_block, total) - 1
    find = lambda t: jnp.clip(
        jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1, 0, max_seqs - 1
    )
    first_seq = find(starts)
    last_seq = jnp.where(starts < total, find(ends), first_seq - 1)

    # [T, H, D] -> [KH, G, T, D]: the query heads of a KV head as one matrix per block.
    q_t = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    kv_flat = kv_pages.reshape(num_pages, page_size * kv_heads_x2, head_dim)  # free: pages are contiguous
    chunk = min(head_dim, 128)  # VMEM holds lanes in chunks of 128: Mosaic's strided loads need it
    q_spec = pl.BlockSpec((num_kv_heads, group, q_block, head_dim), lambda i, *_: (0, 0, i, 0))
    kv_buf_rows = pages_per_block * page_size * kv_heads_x2
    scratch = [
        pltpu.VMEM((2, head_dim // chunk, kv_buf_rows, chunk), kv_pages.dtype),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.VMEM((num_kv_heads, group * q_block, _LANES), jnp.float32),
        pltpu.VMEM((num_kv_heads, group * q_block, _LANES), jnp.float32),
        pltpu.VMEM((num_kv_heads, group * q_block, head_dim), jnp.float32),
    ]
    itemsize = kv_pages.dtype.itemsize
    vmem_bytes = (
        2 * kv_buf_rows * head_dim * itemsize
        + 4 * num_q_heads * q_block * head_dim * itemsize  # q and o blocks, double-buffered
        + num_q_heads * q_block * (2 * _LANES + head_dim) * 4
        + 4 * group * q_block * pages_per_block * page_size * 4  # logits and probabilities
    )
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        page_size=page_size,
        pages_per_block=pages_per_block,
        max_blocks=max_blocks,
        packed_bf16=_PACKED_BF16_LOADS and not interpret,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_q_blocks,),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(q_t.shape, q_t.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",),
            vmem_limit_bytes=int(min(max(2 * vmem_bytes, 32 * 2**20), 96 * 2**20)),
        ),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(kv_lens, block_tables.reshape(-1), cu_q_lens, first_seq, last_seq, q_t, kv_flat)
    return out.transpose(2, 0, 1, 3).reshape(num_tokens, num_q_heads, head_dim).astype(out_dtype)
