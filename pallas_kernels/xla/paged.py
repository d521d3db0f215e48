"""Ragged paged attention in plain XLA: the portable backend and the fast path on CPU.

Layout and masking conventions are in :mod:`.common`.

How it works. The flat token axis is cut into *query rows*: each sequence's queries are split into chunks of
``rows_per_chunk`` consecutive tokens (1 for decode-heavy buckets, more for prefill buckets), so every row
belongs to exactly one sequence and needs only that sequence's pages. A ``while`` loop with a *runtime* trip
count walks blocks of rows, so padding sequences and padding tokens cost nothing; inside, a second ``while``
loop walks the KV of the rows in chunks of whole pages, from the first page any row of the block can see
(sliding-window pages before it are skipped, not masked) to the last one (pages past ``kv_len`` are never
gathered), gathering the pages through the block table and folding them in with an online softmax. Nothing of
size ``num_tokens x max_seqs`` or ``num_tokens x max_context`` is materialised; the working set of one step is
a few MiB, sized by :func:`_plan`.

GQA/MQA: the query heads sharing a KV head are a ``group`` axis of the same einsum, so each gathered KV page
serves all of them.

Quantized pages (``kv_scales`` given, :mod:`.kv_quant`): the int8/e4m3 values are gathered as stored, cast to
the query dtype (exact: they fit bfloat16's mantissa) and the per-key scales are applied to the logits (K) and to
the probabilities (V), which is the same as dequantizing the keys and values (a scale is constant along
``head_dim``) but costs ``rows x keys`` multiplications instead of ``keys x head_dim``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.common import MASK_VALUE, apply_soft_cap, cdiv, kv_dims, visible

# Bytes of gathered KV per inner step (all rows of a block together): big enough that loop overhead is noise,
# small enough to stay in L2/L3 on CPU.
_KV_CHUNK_BYTES = 2 * 1024 * 1024
# Query rows (tokens) handled by one block of the outer loop.
_TOKENS_PER_BLOCK = 8
_MAX_ROWS_PER_CHUNK = 64


class _Plan(NamedTuple):
    rows_per_chunk: int  # consecutive tokens of one sequence per query row
    num_rows: int  # static bound on the number of query rows
    rows_per_block: int  # query rows per outer-loop step
    pages_per_chunk: int  # pages gathered per inner-loop step (per row)


def _plan(
    num_tokens: int,
    max_seqs: int,
    page_size: int,
    max_blocks: int,
    num_kv_heads: int,
    head_dim: int,
    itemsize: int,
) -> _Plan:
    """Static tiling for one bucket shape."""
    # Decode-heavy buckets (about one token per sequence) want one token per row, prefill buckets long rows.
    rows_per_chunk = 1
    while rows_per_chunk * 2 <= min(_MAX_ROWS_PER_CHUNK, num_tokens // (2 * max_seqs)):
        rows_per_chunk *= 2
    # Every row holds at least one real token, and each sequence adds at most one partial row.
    num_rows = min(num_tokens, min(max_seqs, num_tokens) + cdiv(num_tokens, rows_per_chunk))
    rows_per_block = max(1, min(num_rows, _TOKENS_PER_BLOCK // rows_per_chunk))
    page_bytes = page_size * num_kv_heads * 2 * head_dim * itemsize
    pages_per_chunk = max(1, min(max_blocks, _KV_CHUNK_BYTES // (rows_per_block * page_bytes)))
    return _Plan(rows_per_chunk, num_rows, rows_per_block, pages_per_chunk)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window"))
def xla_ragged_paged_attention(
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
    kv_scales: jax.Array | None = None,  # [num_pages, >= num_kv_heads * 2 * page_size] f32, quantized pages
) -> jax.Array:
    """Ragged paged attention; returns ``[num_tokens, num_q_heads, head_dim]`` in ``q.dtype``."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = kv_dims(kv_pages)
    group = num_q_heads // num_kv_heads
    max_seqs, max_blocks = block_tables.shape
    plan = _plan(num_tokens, max_seqs, page_size, max_blocks, num_kv_heads, head_dim, kv_pages.dtype.itemsize)
    quantized = kv_scales is not None
    # float32 queries get float32 dots: without it XLA:GPU runs f32 einsums as TF32 (10-bit mantissa) on
    # Ampere and newer. bfloat16 dots are exact products with f32 accumulation either way.
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    rpc, rpb, ppc = plan.rows_per_chunk, plan.rows_per_block, plan.pages_per_chunk
    num_rows = cdiv(plan.num_rows, rpb) * rpb
    chunk_len = ppc * page_size
    tables = jnp.pad(block_tables, ((0, 0), (0, cdiv(max_blocks, ppc) * ppc - max_blocks)))

    # Per-sequence metadata; padding sequences are emptied so they own no rows.
    n = num_seqs[0]
    seq_ids = jnp.arange(max_seqs, dtype=jnp.int32)
    q_lens = jnp.where(seq_ids < n, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    lens = jnp.where(seq_ids < n, kv_lens, 0)
    cu_rows = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(cdiv(q_lens, rpc), dtype=jnp.int32)])
    total_rows = cu_rows[max_seqs]

    # Per-row metadata.
    row_ids = jnp.arange(num_rows, dtype=jnp.int32)
    row_seq = jnp.clip(jnp.searchsorted(cu_rows, row_ids, side="right").astype(jnp.int32) - 1, 0, max_seqs - 1)
    idx_in_seq = (row_ids - cu_rows[row_seq])[:, None] * rpc + jnp.arange(rpc, dtype=jnp.int32)[None, :]
    q_valid = (row_ids < total_rows)[:, None] & (idx_in_seq < q_lens[row_seq][:, None])  # [rows, rpc]
    q_pos = (lens - q_lens)[row_seq][:, None] + idx_in_seq  # [rows, rpc], int32: no overflow below 2**31
    tok = jnp.where(q_valid, cu_q_lens[row_seq][:, None] + idx_in_seq, 0)
    q_rows = jnp.where(q_valid[..., None, None], q[tok], 0).reshape(num_rows, rpc, num_kv_heads, group, head_dim)
    # The first and last key position each row can see.
    lo = q_pos[:, 0] - sliding_window + 1 if sliding_window is not None else jnp.zeros_like(q_pos[:, 0])
    hi = jnp.max(jnp.where(q_valid, q_pos, -1), axis=1)

    def block_body(b, out_rows):
        start = b * rpb
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, start, rpb)
        seqs, qb, pos_b, valid_b = sl(row_seq), sl(q_rows), sl(q_pos), sl(q_valid)
        live = sl(row_ids) < total_rows
        lens_b, tables_b = lens[seqs], tables[seqs]  # [rpb], [rpb, padded_blocks]
        first = jnp.min(jnp.where(live, jnp.maximum(sl(lo), 0), jnp.iinfo(jnp.int32).max)) // chunk_len
        last = jnp.max(jnp.where(live, sl(hi), -1)) // chunk_len
        qmask = valid_b[:, None, None, :, None]  # [rpb, 1, 1, rpc, 1]
        qpos = pos_b[:, None, None, :, None]

        def kv_body(c, carry):
            m, den, acc = carry
            pages = jax.lax.dynamic_slice_in_dim(tables_b, c * ppc, ppc, axis=1)  # [rpb, ppc]
            kv = kv_pages[pages]  # [rpb, ppc, num_kv_heads, page_size, 2 * head_dim]
            if quantized:
                kv = kv.astype(q.dtype)
            k, v = kv[..., :head_dim], kv[..., head_dim:]
            k_pos = c * chunk_len + jnp.arange(chunk_len, dtype=jnp.int32)
            in_seq = k_pos[None, :] < lens_b[:, None]  # [rpb, chunk_len]
            # Slots past kv_len may hold anything (NaN too).
            v = jnp.where(in_seq.reshape(rpb, ppc, 1, page_size, 1), v, 0)
            s = jnp.einsum("brkgd,bpksd->bkgrps", qb, k, preferred_element_type=jnp.float32, precision=precision)
            if quantized:  # per-key scales [rpb, num_kv_heads, ppc, page_size] for K and V
                assert kv_scales is not None
                sc = kv_scales[pages][..., : 2 * num_kv_heads * page_size]  # without lane-dense padding
                sc = sc.reshape(rpb, ppc, num_kv_heads, 2, page_size).transpose(3, 0, 2, 1, 4)
                sc = jnp.where(in_seq.reshape(rpb, 1, ppc, page_size), sc, 0.0)
                s = s * sc[0][:, :, None, None]
            s = apply_soft_cap(s.reshape(*s.shape[:4], chunk_len) * sm_scale, soft_cap)
            mask = visible(qpos, k_pos, sliding_window) & in_seq[:, None, None, None, :] & qmask
            s = jnp.where(mask, s, MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            den = alpha * den + jnp.sum(p, axis=-1)
            p = p.reshape(*p.shape[:4], ppc, page_size)
            if quantized:
                p = p * sc[1][:, :, None, None]
            p = p.astype(v.dtype)
            pv = jnp.einsum("bkgrps,bpksd->bkgrd", p, v, preferred_element_type=jnp.float32, precision=precision)
            return m_new, den, alpha[..., None] * acc + pv

        shape = (rpb, num_kv_heads, group, rpc)
        init = (
            jnp.full(shape, MASK_VALUE, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32),
        )
        _, den, acc = jax.lax.fori_loop(first, last + 1, kv_body, init)
        out = jnp.where(den[..., None] > 0, acc / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
        out = out.transpose(0, 3, 1, 2, 4).reshape(rpb, rpc, num_q_heads, head_dim).astype(out_rows.dtype)
        return jax.lax.dynamic_update_slice_in_dim(out_rows, out, start, axis=0)

    out_rows = jnp.zeros((num_rows, rpc, num_q_heads, head_dim), q.dtype)
    out_rows = jax.lax.fori_loop(0, cdiv(total_rows, rpb), block_body, out_rows)

    # Scatter rows back to the flat token axis.
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    t_seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1, 0, max_seqs - 1)
    i = t - cu_q_lens[t_seq]
    real = t < cu_q_lens[n]
    row = jnp.where(real, cu_rows[t_seq] + i // rpc, 0)
    out = out_rows[row, jnp.where(real, i % rpc, 0)]
    return jnp.where(real[:, None, None], out, 0).astype(q.dtype)
