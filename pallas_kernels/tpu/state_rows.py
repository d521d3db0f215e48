"""Reading and writing rows of a state pool on TPU, in place in HBM (two small Pallas kernels).

A linear-attention hybrid's conv state is one array per layer, ``[N, (K - 1) * C]`` float32 (Qwen3.5-9B: 129 rows
of 3 x 8192, 12 MiB), and each step reads the rows of its sequences and writes them back
(``paged_jax.model.linear_state.paged_conv``). As XLA ops (a gather and a scatter) XLA:TPU's memory-space
assignment stages an array that small in VMEM whole for them and copies it back: two whole-array copies per layer
per step (the compiled-step audit of ``scripts/checks/check_tpu_compile.py --hybrid`` finds them, as it found them
for small KV caches and for quantized pages' scales, :mod:`.scale_write`). Operands of a ``pallas_call`` can be
pinned to HBM (``pltpu.with_memory_space_constraint``); here the pool never leaves HBM and only the named rows
move, one DMA each. The pool is 2-D so that its device layout is the kernel's (a ``[N, 3, C]`` array gets a
layout with the 3 moved out of the tile, and XLA relays the whole array out for the kernel).

Rows are moved :data:`BLOCK` to a grid step, one DMA at a time, so a row named twice (padding sequences all name
the null row 0) is written in order, never concurrently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK = 8  # rows per grid step: a float32 sublane tile


def _rows_loop(rows_ref, copy):
    base = pl.program_id(0) * BLOCK

    def body(r, carry):
        @pl.when(rows_ref[base + r] >= 0)
        def _():
            dma = copy(r, rows_ref[base + r])
            dma.start()
            dma.wait()

        return carry

    jax.lax.fori_loop(0, BLOCK, body, 0)


def _read_kernel(rows_ref, pool_hbm, out_ref, sem):
    def copy(r, row):
        return pltpu.make_async_copy(pool_hbm.at[pl.ds(row, 1)], out_ref.at[pl.ds(r, 1)], sem.at[0])

    _rows_loop(rows_ref, copy)


def _write_kernel(rows_ref, new_ref, pool_hbm, out_hbm, sem):
    del pool_hbm  # aliased with out_hbm

    def copy(r, row):
        return pltpu.make_async_copy(new_ref.at[pl.ds(r, 1)], out_hbm.at[pl.ds(row, 1)], sem.at[0])

    _rows_loop(rows_ref, copy)


def _padded(rows: jax.Array) -> jax.Array:
    """`rows` padded with -1 (no row) to whole blocks."""
    s = rows.shape[0]
    return jnp.pad(rows.astype(jnp.int32), (0, -(-s // BLOCK) * BLOCK - s), constant_values=-1)


def _pinned(pool: jax.Array, interpret) -> jax.Array:
    return pool if interpret else pltpu.with_memory_space_constraint(pool, pltpu.HBM)


def read_rows_tpu(pool: jax.Array, rows: jax.Array, interpret: bool | pltpu.InterpretParams = False) -> jax.Array:
    """``pool[rows]``: pool [N, W], rows [S] int32 in [0, N) -> [S, W], the pool read where it is."""
    s, w = rows.shape[0], pool.shape[1]
    padded = _padded(rows)
    out = pl.pallas_call(
        _read_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(padded.shape[0] // BLOCK,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((BLOCK, w), lambda i, rows: (i, 0)),
            scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
        ),
        out_shape=jax.ShapeDtypeStruct((padded.shape[0], w), pool.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="read_state_rows_tpu",
    )(padded, _pinned(pool, interpret))
    return out[:s]


def write_rows_tpu(
    pool: jax.Array, rows: jax.Array, new: jax.Array, interpret: bool | pltpu.InterpretParams = False
) -> jax.Array:
    """``pool.at[rows].set(new)`` in place (aliased, in HBM) under a jit that donates ``pool``: pool [N, W],
    rows [S] int32 in [0, N), new [S, W]. A row named twice gets the later one."""
    s, w = rows.shape[0], pool.shape[1]
    padded = _padded(rows)
    new = jnp.pad(new.astype(pool.dtype), ((0, padded.shape[0] - s), (0, 0)))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        _write_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(padded.shape[0] // BLOCK,),
            in_specs=[pl.BlockSpec((BLOCK, w), lambda i, rows: (i, 0)), any_spec],
            out_specs=any_spec,
            scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
        ),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={2: 0},  # pool (after rows, new) -> out
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="write_state_rows_tpu",
    )(padded, new, _pinned(pool, interpret))


__all__ = ["BLOCK", "read_rows_tpu", "write_rows_tpu"]
