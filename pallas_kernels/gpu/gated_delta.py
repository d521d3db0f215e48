"""The gated delta rule over a paged step on GPU (Pallas/Triton): the recurrent form, ragged over the step's
sequences, each reading and writing its row of a state pool in place.

The rule: :mod:`pallas_kernels.gated_delta`; the step's layout and the pool: :mod:`pallas_kernels.ragged_gated_delta`.
One program per (sequence, value head, block of ``block_v`` value columns): it holds its ``[Dk, block_v]``
float32 slice of the sequence's state in registers (its pool row's slice, or zeros for a fresh sequence), walks
the sequence's tokens in order (``S *= e^g``, ``S += k (beta (v - k^T S))^T``, ``o = S^T q``, column-wise
products and sums: no MMA) and writes the slice back. Each program owns distinct output rows and state
columns, so the programs need no synchronisation; a decode step is one token per program. Sequences of a
step's prefill chunks run the same loop over their tokens (the chunked form's matmuls are a TPU kernel only so
far: :mod:`pallas_kernels.tpu.gated_delta`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK_V = 32  # value columns per program: a [128, 32] f32 state slice is 32 registers a thread at 4 warps


def _kernel(
    cu_ref,  # [max_seqs + 1] int32
    num_ref,  # [1] int32
    slots_ref,  # [max_seqs] int32
    fresh_ref,  # [max_seqs] int32 (1: start from zeros)
    q_ref,  # [T, H, Dk]
    k_ref,  # [T, H, Dk]
    v_ref,  # [T, H, Dv]
    g_ref,  # [T, H] f32
    b_ref,  # [T, H] f32
    pool_in,  # [N, H, Dk, Dv] f32, aliased to pool_ref
    out_in,  # [T, H, Dv] f32 zeros, aliased to o_ref
    o_ref,
    pool_ref,
    *,
    block_v: int,
):
    del pool_in, out_in
    s, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = cu_ref[s], cu_ref[s + 1]
    cols = pl.ds(j * block_v, block_v)
    f32 = jnp.float32

    @pl.when((s < num_ref[0]) & (end > start))
    def _():
        slot = slots_ref[s]
        dk = q_ref.shape[2]
        state = pool_ref[slot, h, :, cols]  # [Dk, block_v]
        state = jnp.where(fresh_ref[s] != 0, jnp.zeros((dk, block_v), f32), state)

        def token(t, st):
            q = q_ref[t, h, :].astype(f32)  # [Dk]
            k = k_ref[t, h, :].astype(f32)
            v = v_ref[t, h, cols].astype(f32)  # [block_v]
            st = st * jnp.exp(g_ref[t, h])
            delta = (v - jnp.sum(k[:, None] * st, axis=0)) * b_ref[t, h]
            st = st + k[:, None] * delta[None, :]
            o_ref[t, h, cols] = jnp.sum(q[:, None] * st, axis=0)
            return st

        pool_ref[slot, h, :, cols] = jax.lax.fori_loop(start, end, token, state)


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "num_warps"))
def gated_delta_gpu(
    q: jax.Array,  # [T, H, Dk]
    k: jax.Array,  # [T, H, Dk]
    v: jax.Array,  # [T, H, Dv]
    g: jax.Array,  # [T, H]
    beta: jax.Array,  # [T, H]
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32
    num_seqs: jax.Array,  # [1] int32
    seq_slots: jax.Array,  # [max_seqs] int32
    seq_fresh: jax.Array,  # [max_seqs] bool
    pool: jax.Array,  # [num_slots, H, Dk, Dv] float32
    *,
    interpret: bool = False,
    block_v: int = BLOCK_V,
    num_warps: int = 4,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule of a paged step on GPU (module docstring). Returns (out [T, H, Dv] float32, zeros
    on padding rows; the pool with every sequence's row updated in place)."""
    t, h, dk = q.shape
    dv = v.shape[-1]
    block_v = min(block_v, dv)
    if dv % block_v or dk & (dk - 1) or block_v & (block_v - 1):
        raise ValueError(f"GPU gated delta: Dk ({dk}) and block_v ({block_v}) must be powers of two dividing Dv ({dv})")
    max_seqs = seq_slots.shape[0]
    operands = (
        cu_q_lens.astype(jnp.int32),
        num_seqs.astype(jnp.int32),
        seq_slots.astype(jnp.int32),
        seq_fresh.astype(jnp.int32),
        q,
        k,
        v,
        g.astype(jnp.float32),
        beta.astype(jnp.float32),
        pool,
        jnp.zeros((t, h, dv), jnp.float32),
    )
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    out, pool = pl.pallas_call(
        functools.partial(_kernel, block_v=block_v),
        grid=(max_seqs, h, dv // block_v),
        in_specs=[whole(x) for x in operands],
        out_specs=[whole(operands[10]), whole(pool)],
        out_shape=[jax.ShapeDtypeStruct((t, h, dv), jnp.float32), jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
        input_output_aliases={10: 0, 9: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=8 * t * h * dk * dv,
            transcendentals=t * h * (dv // block_v),
            bytes_accessed=2 * max_seqs * h * dk * dv * 4 + t * h * (2 * dk + dv) * q.dtype.itemsize + t * h * dv * 4,
        ),
        name="gated_delta_gpu",
    )(*operands)
    return out, pool


__all__ = ["BLOCK_V", "gated_delta_gpu"]
