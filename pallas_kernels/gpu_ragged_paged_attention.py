"""Ragged paged attention for NVIDIA GPUs (Pallas, Triton lowering): decode, chunked prefill, prefill.

Layout and masking conventions: :mod:`pallas_kernels.common`.

Why Triton and not Mosaic GPU. In jax 0.11.2 the Triton lowering is the mature path for this kernel's shape of
work: its programs load through computed pointers, so "gather the pages named by this block-table row" is one
indexed load (``kv_ref[pages]``) that Triton software-pipelines over ``num_stages``, and it runs on every CUDA
GPU JAX supports (Ampere and newer). Mosaic GPU is the future (warp specialisation, TMA, wgmma on
Hopper/Blackwell), but its programming model is explicit TMA copies of rectangular tiles into shared memory
with barriers; a page gather needs one TMA per page, warpgroup-shaped tiles, and a Hopper-or-newer GPU, and
its API is still moving release to release. The cost of this choice: jax 0.11.2 already warns that the Pallas
Triton backend is deprecated; we pin jax, and the Mosaic GPU version, when it comes, is a port of the TPU
kernel's structure (DMA'd pages, double buffering), not of this one.

Grid ``(num_kv_heads, num_q_blocks)``: a program owns the query heads of one KV head (``group`` of them,
padded to a power of two) for ``q_block`` consecutive flat tokens, a ``[q_block * group, head_dim]`` matrix,
so each page of that KV head is read from global memory once per program for all its query heads. The program
walks the sequences that own tokens of its block (``first_seq``/``last_seq`` from the wrapper) and, for each,
the KV blocks of ``pages_per_block`` pages its rows can see: pages before a sliding window and past the last
query position are never loaded. Online softmax in float32 registers with a finite mask value; probabilities
of masked keys are zero and V rows past ``kv_len`` are zeroed, so stale or NaN slots and padding rows cannot
leak. Decode buckets use small ``q_block`` (one or a few sequences per program, enough programs to fill the
SMs); prefill buckets use larger ones."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import MASK_VALUE, apply_soft_cap, cdiv, validate_kernel_shape


def _kernel(
    # Metadata (global memory, read as scalars).
    kv_lens_ref,  # [max_seqs] int32
    tables_ref,  # [max_seqs, padded_blocks] int32, padded with page 0 to a multiple of pages_per_block
    cu_q_lens_ref,  # [max_seqs + 1] int32
    first_seq_ref,  # [num_q_blocks] int32
    last_seq_ref,  # [num_q_blocks] int32 (< first when the block is all padding)
    # Inputs.
    q_ref,  # [q_block * group, head_dim], row r = token r // group, query head r % group of this KV head
    k_ref,  # [num_pages, page_size, head_dim], K of this KV head
    v_ref,  # [num_pages, page_size, head_dim], V of this KV head
    # Outputs.
    o_ref,  # [q_block * group, head_dim]
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    group: int,
    pages_per_block: int,
):
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    q_block = rows // group
    kv_block = pages_per_block * page_size
    blk = pl.program_id(1)
    blk_start = blk * q_block
    blk_end = blk_start + q_block
    q = q_ref[...]
    tok = blk_start + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group  # [rows, 1]

    def seq_body(s, carry):
        q_start, q_end, kv_len = cu_q_lens_ref[s], cu_q_lens_ref[s + 1], kv_lens_ref[s]
        lo, hi = jnp.maximum(q_start, blk_start), jnp.minimum(q_end, blk_end)
        first_pos = kv_len - (q_end - q_start) + (lo - q_start)
        last_pos = first_pos + (hi - lo) - 1
        first_key = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
        b_lo = first_key // kv_block
        b_hi = jnp.where(hi > lo, last_pos // kv_block + 1, b_lo)
        q_pos = kv_len - (q_end - q_start) + (tok - q_start)  # [rows, 1]
        row_in_seq = (tok >= q_start) & (tok < q_end)

        def kv_body(b, carry):
            m, den, acc = carry
            pages = tables_ref[s, pl.ds(b * pages_per_block, pages_per_block)]
            k = k_ref[pages].reshape(kv_block, head_dim)
            v = v_ref[pages].reshape(kv_block, head_dim)
            k_pos = b * kv_block + jax.lax.broadcasted_iota(jnp.int32, (1, kv_block), 1)  # [1, kv_block]
            mask = row_in_seq & (k_pos <= q_pos)
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            logits = pltriton.dot(q, k, trans_b=True, allow_tf32=False) * sm_scale  # float32 accumulate
            logits = jnp.where(mask, apply_soft_cap(logits, soft_cap), MASK_VALUE)
            m_next = jnp.maximum(m, jnp.max(logits, axis=1))
            alpha = jnp.exp(m - m_next)
            p = jnp.where(mask, jnp.exp(logits - m_next[:, None]), 0.0)
            v_pos = b * kv_block + jax.lax.broadcasted_iota(jnp.int32, (kv_block, 1), 0)
            v = jnp.where(v_pos < kv_len, v, jnp.zeros_like(v))
            acc = alpha[:, None] * acc + pltriton.dot(p.astype(v.dtype), v, allow_tf32=False)
            return m_next, alpha * den + jnp.sum(p, axis=1), acc

        return jax.lax.fori_loop(b_lo, b_hi, kv_body, carry)

    init = (
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    _, den, acc = jax.lax.fori_loop(first_seq_ref[blk], last_seq_ref[blk] + 1, seq_body, init)
    out = jnp.where(den[:, None] > 0, acc / jnp.where(den > 0, den, 1.0)[:, None], 0.0)
    o_ref[...] = out.astype(o_ref.dtype)


def default_block_sizes(num_tokens: int, max_seqs: int, group: int, page_size: int) -> tuple[int, int]:
    """``(q_block, pages_per_block)``: ~16 query rows per program for decode buckets (many programs), 64 for
    prefill buckets; KV blocks of about 64 slots (a few pages) to keep registers and shared memory small."""
    target_rows = 16 if num_tokens <= 2 * max_seqs else 64
    q_block = max(1, min(num_tokens, target_rows // group))
    pages_per_block = max(1, 64 // page_size)
    return q_block, pages_per_block


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "interpret",
        "q_block",
        "pages_per_block",
        "num_warps",
        "num_stages",
    ),
)
def ragged_paged_attention_gpu(
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
    interpret: bool = False,
    q_block: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """Ragged paged attention on GPU; returns ``[num_tokens, num_q_heads, head_dim]`` in ``q.dtype``.

    ``q_block`` (tokens per program) and ``pages_per_block`` (pages per KV step) default to
    :func:`default_block_sizes`. ``interpret=True`` runs the kernel in the Pallas interpreter (CPU is fine).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads_x2, _ = kv_pages.shape
    num_kv_heads = kv_heads_x2 // 2
    group = num_q_heads // num_kv_heads
    max_seqs, max_blocks = block_tables.shape
    validate_kernel_shape(head_dim, page_size)
    group_p = 1 << (group - 1).bit_length()  # Triton tiles are powers of two
    d_q_block, d_pages = default_block_sizes(num_tokens, max_seqs, group_p, page_size)
    q_block = q_block or d_q_block
    pages_per_block = min(pages_per_block or d_pages, 1 << (max_blocks - 1).bit_length())
    if num_tokens % q_block:
        raise ValueError(f"q_block ({q_block}) must divide num_tokens ({num_tokens})")
    rows = q_block * group_p
    num_q_blocks = num_tokens // q_block

    total = cu_q_lens[num_seqs[0]]
    starts = jnp.arange(num_q_blocks, dtype=jnp.int32) * q_block
    ends = jnp.minimum(starts + q_block, total) - 1
    find = lambda t: jnp.clip(
        jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1, 0, max_seqs - 1
    )
    first_seq = find(starts)
    last_seq = jnp.where(starts < total, find(ends), first_seq - 1)
    tables = jnp.pad(
        block_tables, ((0, 0), (0, cdiv(max_blocks, pages_per_block) * pages_per_block - max_blocks))
    )

    # [T, H, D] -> [KH, T * G_pad, D], token-major inside a KV head.
    q_t = q.astype(kv_pages.dtype).reshape(num_tokens, num_kv_heads, group, head_dim)
    q_t = jnp.pad(q_t, ((0, 0), (0, 0), (0, group_p - group), (0, 0)))
    q_t = q_t.transpose(1, 0, 2, 3).reshape(num_kv_heads, num_tokens * group_p, head_dim)

    full = lambda x: pl.BlockSpec(x.shape, lambda h, i: (0,) * x.ndim)
    kv_spec = lambda half: pl.BlockSpec(
        (num_pages, page_size, None, head_dim), lambda h, i: (0, 0, 2 * h + half, 0)
    )
    q_spec = pl.BlockSpec((None, rows, head_dim), lambda h, i: (h, i, 0))
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        group=group_p,
        pages_per_block=pages_per_block,
    )
    out = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_q_blocks),
        in_specs=[
            full(kv_lens),
            full(tables),
            full(cu_q_lens),
            full(first_seq),
            full(last_seq),
            q_spec,
            kv_spec(0),
            kv_spec(1),
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q_t.shape, kv_pages.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(kv_lens, tables, cu_q_lens, first_seq, last_seq, q_t, kv_pages, kv_pages)
    out = out.reshape(num_kv_heads, num_tokens, group_p, head_dim)[:, :, :group]
    return out.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
