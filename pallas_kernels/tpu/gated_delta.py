"""The gated delta rule over a paged step on TPU (Pallas/Mosaic): the chunked form for prefill and chunked
prefill, the recurrent form for decode, both reading and writing each sequence's row of a state pool in place.

The rule and its two forms: :mod:`pallas_kernels.gated_delta`. The work lists: :mod:`pallas_kernels.gated_delta_plan`.
Two ``pallas_call`` s, both aliasing the pool (``[num_slots, H, Dk, Dv]`` float32) and the output:

- Chunk kernel, one grid step per chunk item (``chunk`` tokens of one sequence), sequential (``arbitrary``):
  the sequence's state lives in a ``[H, Dk, Dv]`` f32 VMEM scratch from its first chunk (a DMA from its pool
  row, or zeros for a fresh sequence) to its last (a DMA back to the row), so a sequence's state crosses its
  chunks without touching HBM. An item reads a window of ``chunk + 16`` rows of q, k, v (``[H, T, D]``, the
  wrapper's transposes) starting at the 16-row tile below its first token (a DMA cuts a tiled HBM array only
  at tile rows), and its g and beta gathered per item (``[2, H, R]``). Rows outside the item are masked to
  g = beta = k = q = v = 0, which leaves the state and the item's rows exact; the output window is read,
  modified in the item's rows only, and written back, so items (in token order, each waiting for its write)
  never clobber each other's rows.
  Per head (a ``fori_loop``; every product a 2-D MXU dot at ``HIGHEST`` precision) the chunk is the UT
  transform of the reference: ``A = tril(K_beta K^T * decay, -1)``, ``T = (I + A)^-1`` by forward
  substitution (one row product ``[1, R] x [R, R]`` per token), ``V_new = T V_beta - (T diag(e^cum) K_beta) S``,
  ``O = diag(e^cum) Q S + (Q K^T * decay) V_new``, ``S <- e^{cum_last} S + (diag(e^{cum_last - cum}) K)^T V_new``.
  Per-token scalars become per-row factors through ``diag(r) X`` products (Mosaic keeps ``[R]`` vectors along
  lanes; the product needs no lane-to-sublane relayout), and ``diag(cum) 1`` gives ``cum`` along rows.
- Decode kernel, one grid step per one-token sequence (sequential): the state row comes as a pipelined
  ``BlockSpec`` block (indexed by the slot table, scalar-prefetched) and leaves through the aliased output
  block, so the next item's state is in flight while one computes. Per head: ``S *= e^g``, ``S += k^T (beta (v -
  k S))``, ``o = q S``; e^g and beta come from SMEM, q/k/v rows gathered in float32 (Mosaic loads one head's
  row at a dynamic sublane only from 32-bit arrays).

The state never leaves the pool except for the rows a step owns: no copy of the pool (the compile checks
audit the HLO: ``scripts/checks/gated_delta_tpu.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import cdiv
from pallas_kernels.gated_delta_plan import (
    FIRST,
    FRESH,
    LAST,
    GatedDeltaPlan,
    chunk_items,
    chunk_static_work,
    decode_items,
    decode_static_work,
    plan_gated_delta,
)
from pallas_kernels.tpu import limits as tpu_limits

_HI = jax.lax.Precision.HIGHEST
_LANES = 128
# Windows start at a multiple of this many tokens: a DMA may cut a tiled HBM array only at tile rows (16 for
# 16-bit q/k/v, 8 for float32). An item's window is its chunk plus its offset into the first tile.
_ALIGN = 16


def _dot(a, b):
    return jnp.dot(a, b, precision=_HI, preferred_element_type=jnp.float32)


def _dot_t(a, b):
    """``a^T b`` for ``a [m, k]``, ``b [m, n]``: contracting the rows of both."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HI, preferred_element_type=jnp.float32)


def _dot_nt(a, b):
    """``a b^T`` for ``a [m, k]``, ``b [n, k]``."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI, preferred_element_type=jnp.float32)


def _chunk_kernel(
    # Scalar prefetch (SMEM), [num_items] each.
    t0_ref,
    n_ref,
    slot_ref,
    flags_ref,
    # Inputs (HBM).
    q_hbm,  # [H, Tp, Dk]
    k_hbm,  # [H, Tp, Dk]
    v_hbm,  # [H, Tp, Dv]
    gb_hbm,  # [num_items, 2, H, R] f32: g and beta of each item's window
    pool_in,  # [N, H, Dk, Dv] f32, aliased to pool_hbm
    out_in,  # [H, Tp, Dv] f32, aliased to out_hbm
    # Outputs (HBM).
    out_hbm,
    pool_hbm,
    # Scratch.
    q_buf,  # [H, R, Dk]
    k_buf,
    v_buf,
    gb_buf,  # [2, H, R] f32
    o_buf,  # [H, R, Dv] f32
    s_ref,  # [H, Dk, Dv] f32: the current sequence's state
    a_ref,  # [R, R] f32: one head's A
    t_ref,  # [R, R] f32: one head's (I + A)^-1
    sem,  # DMA [3]: inputs, state, output
):
    del pool_in, out_in  # the same buffers as the outputs
    h_count, r_len = gb_buf.shape[1:]
    i = pl.program_id(0)
    t0, n, slot, flags = t0_ref[i], n_ref[i], slot_ref[i], flags_ref[i]
    off = t0 % _ALIGN
    base = pl.multiple_of(t0 - off, _ALIGN)
    f32 = jnp.float32

    @pl.when(n > 0)
    def _():
        window = lambda hbm: hbm.at[:, pl.ds(base, r_len)]
        ins = [
            pltpu.make_async_copy(window(src), dst, sem.at[0])
            for src, dst in ((q_hbm, q_buf), (k_hbm, k_buf), (v_hbm, v_buf), (out_hbm, o_buf))
        ]
        ins.append(pltpu.make_async_copy(gb_hbm.at[i], gb_buf, sem.at[0]))
        for cp in ins:
            cp.start()
        load = pltpu.make_async_copy(pool_hbm.at[slot], s_ref, sem.at[1])
        reads = ((flags & FIRST) != 0) & ((flags & FRESH) == 0)
        pl.when(reads)(load.start)

        @pl.when(((flags & FIRST) != 0) & ((flags & FRESH) != 0))
        def _():
            s_ref[...] = jnp.zeros(s_ref.shape, f32)

        for cp in ins:
            cp.wait()
        pl.when(reads)(load.wait)

        shape = (r_len, r_len)
        row = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
        col = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
        eye = (row == col).astype(f32)
        upper_incl = (row <= col).astype(f32)  # [t, i]: t <= i, so x @ upper_incl is the inclusive cumsum
        ones = jnp.ones(shape, f32)
        in_item = lambda x: (x >= off) & (x < off + n)
        lane = jax.lax.broadcasted_iota(jnp.int32, (1, r_len), 1)
        lane_ok = in_item(lane)  # [1, R]
        row_ok = in_item(jax.lax.broadcasted_iota(jnp.int32, (r_len, 1), 0))  # [R, 1]
        pair_ok = (col <= row) & in_item(row) & in_item(col)
        strict = pair_ok & (col < row)

        def diag(x):  # [1, R] -> [R, R] with x on the diagonal
            return eye * x

        def head(h, carry):
            g = jnp.where(lane_ok, gb_buf[0, pl.ds(h, 1), :], 0.0)  # [1, R]
            beta = jnp.where(lane_ok, gb_buf[1, pl.ds(h, 1), :], 0.0)
            q = jnp.where(row_ok, q_buf[h].astype(f32), 0.0)  # [R, Dk]
            k = jnp.where(row_ok, k_buf[h].astype(f32), 0.0)
            v = jnp.where(row_ok, v_buf[h].astype(f32), 0.0)  # [R, Dv]
            cum = _dot(g, upper_incl)  # [1, R]: log decay from the window's start through token i
            cum_rows = _dot(diag(cum), ones)  # [R, R]: cum[i] in row i
            decay = jnp.where(pair_ok, jnp.exp(jnp.where(pair_ok, cum_rows - cum, 0.0)), 0.0)
            k_beta = _dot(diag(beta), k)
            v_beta = _dot(diag(beta), v)
            a_ref[...] = jnp.where(strict, _dot_nt(k_beta, k) * decay, 0.0)
            t_ref[...] = eye

            def subst(r, carry):  # row r of (I + A)^-1 = e_r - A[r] (I + A)^-1 (rows < r are done)
                e_r = (lane == r).astype(f32)
                t_ref[pl.ds(r, 1), :] = e_r - _dot(a_ref[pl.ds(r, 1), :], t_ref[...])
                return carry

            jax.lax.fori_loop(off, off + n, subst, 0)
            inv = t_ref[...]
            e_cum = jnp.where(lane_ok, jnp.exp(cum), 0.0)  # [1, R]
            s = s_ref[h]  # [Dk, Dv]
            k_cumdecay = _dot(inv, _dot(diag(e_cum), k_beta))  # [R, Dk]
            v_new = _dot(inv, v_beta) - _dot(k_cumdecay, s)  # [R, Dv]
            attn = _dot_nt(q, k) * decay
            o = _dot(_dot(diag(e_cum), q), s) + _dot(attn, v_new)
            o_buf[h] = jnp.where(row_ok, o, o_buf[h])  # rows of other items keep what they hold
            last = jnp.sum(g, axis=1, keepdims=True)  # [1, 1]: cum through the last real token
            tail = jnp.where(lane_ok, jnp.exp(last - cum), 0.0)  # [1, R]
            s_ref[h] = s * jnp.exp(last) + _dot_t(_dot(diag(tail), k), v_new)
            return carry

        jax.lax.fori_loop(0, h_count, head, 0)
        out = pltpu.make_async_copy(o_buf, window(out_hbm), sem.at[2])
        out.start()
        store = pltpu.make_async_copy(s_ref, pool_hbm.at[slot], sem.at[1])
        writes = (flags & LAST) != 0
        pl.when(writes)(store.start)
        out.wait()
        pl.when(writes)(store.wait)


def _decode_kernel(
    t0_ref,  # scalar prefetch [num_items]: the token row (num_tokens for padding)
    n_ref,
    slot_ref,
    flags_ref,
    decay_ref,  # SMEM [num_items * H] f32: e^g of the item's token per head
    beta_ref,  # SMEM [num_items * H] f32
    q_ref,  # [H, Dk] f32: the item's token
    k_ref,
    v_ref,  # [H, Dv] f32
    s_in,  # [H, Dk, Dv] f32: the item's pool row
    o_in,  # aliased output rows (unread)
    o_ref,  # [H, Dv] f32
    s_out,  # [H, Dk, Dv] f32: the same pool row
):
    del t0_ref, slot_ref, o_in
    i = pl.program_id(0)
    h_count = q_ref.shape[0]
    real, fresh = n_ref[i] > 0, (flags_ref[i] & FRESH) != 0
    f32 = jnp.float32

    @pl.when(real)
    def _():
        def head(h, carry):
            d = decay_ref[i * h_count + h]
            b = beta_ref[i * h_count + h]
            s = jnp.where(fresh, 0.0, s_in[h]) * d  # [Dk, Dv]
            k = k_ref[pl.ds(h, 1), :]  # [1, Dk]
            delta = (v_ref[pl.ds(h, 1), :] - _dot(k, s)) * b  # [1, Dv]
            s = s + _dot_t(k, delta)
            s_out[h] = s
            o_ref[pl.ds(h, 1), :] = _dot(q_ref[pl.ds(h, 1), :], s)
            return carry

        jax.lax.fori_loop(0, h_count, head, 0)

    @pl.when(~real)
    def _():  # the block goes back to its row whatever happens: leave it as it was
        s_out[...] = s_in[...]
        o_ref[...] = jnp.zeros(o_ref.shape, f32)


def chunk_vmem_bytes(plan: GatedDeltaPlan, itemsize: int) -> int:
    """VMEM of one chunk grid step with Mosaic's tile padding, over windows of ``chunk + 16`` rows: the
    q/k/v/g/beta/out buffers, the state, A and its inverse, and one head's f32 temporaries (a dozen ``[R, R]``
    / ``[R, D]`` arrays)."""
    lanes = lambda x: cdiv(x, _LANES) * _LANES
    h, c, dk, dv = plan.num_heads, plan.chunk + _ALIGN, plan.key_dim, plan.value_dim
    sub = lambda x, it: cdiv(x, 32 // it) * (32 // it)
    return (
        h * sub(c, itemsize) * (2 * lanes(dk) + lanes(dv)) * itemsize  # q, k, v
        + 2 * sub(h, 4) * lanes(c) * 4  # g, beta
        + h * c * lanes(dv) * 4  # out
        + h * dk * lanes(dv) * 4  # state
        + 2 * c * lanes(c) * 4  # A, inverse
        + 12 * c * lanes(max(c, dk, dv)) * 4  # one head's temporaries
    )


def decode_vmem_bytes(plan: GatedDeltaPlan, itemsize: int) -> int:
    """VMEM of the decode kernel's pipelined blocks: two buffers each of the state in and out, q/k/v and out."""
    lanes = lambda x: cdiv(x, _LANES) * _LANES
    h, dk, dv = plan.num_heads, plan.key_dim, plan.value_dim
    sub = lambda x, it: cdiv(x, 32 // it) * (32 // it)
    state = h * dk * lanes(dv) * 4
    rows = sub(h, itemsize) * (2 * lanes(dk) + lanes(dv)) * itemsize + sub(h, 4) * lanes(dv) * 4
    return 2 * (2 * state + rows) + 4 * dk * lanes(dv) * 4


def _in_hbm(xs, interpret):
    """The operands pinned to HBM: ``memory_space=ANY`` alone lets XLA place a small array in VMEM, where the
    kernel's DMAs at token offsets would need tile-aligned offsets, and a VMEM-staged pool would be a copy of
    the pool (the attention kernel's pages, same reason)."""
    return xs if interpret else tuple(pltpu.with_memory_space_constraint(x, pltpu.HBM) for x in xs)


def _run_chunks(plan, items, q, k, v, g, beta, pool, *, interpret, generation):
    """The chunk range: returns (out [H, Tp, Dv] f32, pool)."""
    t, h, dk = q.shape
    dv = v.shape[-1]
    r_len = plan.chunk + _ALIGN
    tp = t + r_len
    pad = lambda x: jnp.pad(x, [(0, tp - t)] + [(0, 0)] * (x.ndim - 1))
    qt, kt, vt = (pad(x).transpose(1, 0, 2) for x in (q, k, v))  # [H, Tp, D]
    # g and beta of each item's window, gathered (a few hundred KiB): the kernel reads them as [H, R] rows,
    # which a DMA from a [H, Tp] array could only cut at 128-lane offsets.
    rows = (items.t0 - items.t0 % _ALIGN)[:, None] + jnp.arange(r_len, dtype=jnp.int32)  # [items, R]
    gb = jnp.stack([pad(g.astype(jnp.float32))[rows], pad(beta.astype(jnp.float32))[rows]], axis=1)  # [items, 2, R, H]
    gb = gb.transpose(0, 1, 3, 2)  # [items, 2, H, R]
    out = jnp.zeros((h, tp, dv), jnp.float32)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    vmem = chunk_vmem_bytes(plan, q.dtype.itemsize)
    scratch = [
        pltpu.VMEM((h, r_len, dk), q.dtype),
        pltpu.VMEM((h, r_len, dk), k.dtype),
        pltpu.VMEM((h, r_len, dv), v.dtype),
        pltpu.VMEM((2, h, r_len), jnp.float32),
        pltpu.VMEM((h, r_len, dv), jnp.float32),
        pltpu.VMEM((h, dk, dv), jnp.float32),
        pltpu.VMEM((r_len, r_len), jnp.float32),
        pltpu.VMEM((r_len, r_len), jnp.float32),
        pltpu.SemaphoreType.DMA((3,)),
    ]
    steps = jnp.maximum(jnp.sum(items.n > 0), 1).astype(jnp.int32)
    work = chunk_static_work(plan, q.dtype.itemsize, r_len)
    out, pool = pl.pallas_call(
        _chunk_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(steps,),
            in_specs=[any_spec] * 6,
            out_specs=[any_spec, any_spec],
            scratch_shapes=scratch,
        ),
        out_shape=[jax.ShapeDtypeStruct(out.shape, out.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
        input_output_aliases={9: 0, 8: 1},  # after 4 scalar operands: q k v gb (4-7), pool 8, out 9
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=tpu_limits.vmem_limit(vmem, generation)
        ),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=work.issued_flops, transcendentals=work.exps, bytes_accessed=work.hbm_bytes
        ),
        name="gated_delta_chunk_tpu",
    )(*items, *_in_hbm((qt, kt, vt, gb, pool, out), interpret))
    return out, pool


def _run_decode(plan, items, q, k, v, g, beta, pool, out, *, interpret, generation):
    """The decode range over ``out`` ([T + 1, H, Dv] f32, aliased): returns (out, pool)."""
    t, h, dk = q.shape
    dv = v.shape[-1]
    # The items' rows in float32, gathered (at most max_seqs rows): the kernel reads one head's row at a time,
    # which Mosaic loads at a dynamic sublane only from 32-bit arrays. Padding items read row t: zeros.
    pad = lambda x: jnp.pad(x.astype(jnp.float32), [(0, 1)] + [(0, 0)] * (x.ndim - 1))
    qp, kp, vp = (pad(x)[items.t0] for x in (q, k, v))  # [num_items, H, D]
    decay = jnp.exp(pad(g)[items.t0]).reshape(-1)  # [num_items * H]
    rate = pad(beta)[items.t0].reshape(-1)
    vmem = decode_vmem_bytes(plan, 4)
    dwork = decode_static_work(plan, q.dtype.itemsize)
    item_spec = lambda d: pl.BlockSpec((None, h, d), lambda i, t0, n, slot, fl: (i, 0, 0))
    row_spec = lambda d: pl.BlockSpec((None, h, d), lambda i, t0, n, slot, fl: (t0[i], 0, 0))
    state_spec = pl.BlockSpec((None, h, dk, dv), lambda i, t0, n, slot, fl: (slot[i], 0, 0, 0))
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    steps = jnp.maximum(jnp.sum(items.n > 0), 1).astype(jnp.int32)
    out, pool = pl.pallas_call(
        _decode_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(steps,),
            in_specs=[smem, smem, item_spec(dk), item_spec(dk), item_spec(dv), state_spec, row_spec(dv)],
            out_specs=[row_spec(dv), state_spec],
            scratch_shapes=[],
        ),
        out_shape=[jax.ShapeDtypeStruct(out.shape, out.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
        input_output_aliases={10: 0, 9: 1},  # after 4 scalar operands: decay beta q k v (4-8), pool 9, out 10
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=tpu_limits.vmem_limit(vmem, generation)
        ),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=dwork.issued_flops, transcendentals=dwork.exps, bytes_accessed=dwork.hbm_bytes
        ),
        name="gated_delta_decode_tpu",
    )(*items, decay, rate, qp, kp, vp, *_in_hbm((pool,), interpret), out)
    return out, pool


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret", "generation"))
def gated_delta_tpu(
    q: jax.Array,  # [T, H, Dk]: L2-normalised, scaled by Dk ** -0.5
    k: jax.Array,  # [T, H, Dk]: L2-normalised
    v: jax.Array,  # [T, H, Dv]
    g: jax.Array,  # [T, H]: log decay, <= 0
    beta: jax.Array,  # [T, H]
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32
    num_seqs: jax.Array,  # [1] int32
    seq_slots: jax.Array,  # [max_seqs] int32: each sequence's pool row
    seq_fresh: jax.Array,  # [max_seqs] bool: start from zeros, not the row
    pool: jax.Array,  # [num_slots, H, Dk, Dv] float32
    *,
    chunk_size: int = 64,
    interpret: bool | pltpu.InterpretParams = False,
    generation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule of a paged step on TPU (module docstring). Returns (out [T, H, Dv] float32, zeros
    on padding rows; the pool with every sequence's row updated in place)."""
    t, h, dk = q.shape
    dv = v.shape[-1]
    plan = plan_gated_delta(t, seq_slots.shape[0], h, dk, dv, chunk_size)
    meta = (cu_q_lens, num_seqs[0], seq_slots.astype(jnp.int32), seq_fresh.astype(bool))
    opts = dict(interpret=interpret, generation=generation)
    chunks = chunk_items(jnp, plan, *meta)
    out_t, pool = _run_chunks(plan, chunks, q, k, v, g, beta, pool, **opts)
    out = out_t[:, : t + 1].transpose(1, 0, 2)  # [T + 1, H, Dv]
    decodes = decode_items(jnp, plan, *meta)
    out, pool = _run_decode(plan, decodes, q, k, v, g, beta, pool, out, **opts)
    valid = jnp.arange(t) < cu_q_lens[num_seqs[0]]
    return jnp.where(valid[:, None, None], out[:t], 0.0), pool


__all__ = ["chunk_vmem_bytes", "decode_vmem_bytes", "gated_delta_tpu"]
