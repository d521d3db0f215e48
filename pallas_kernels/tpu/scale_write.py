"""Writing new K/V scales into quantized pages' scale rows on TPU, in place in HBM (a Pallas kernel).

Why not the XLA scatter that writes the values (:func:`.kv_update.write_kv`): XLA:TPU's memory-space assignment
stages a scale array that fits VMEM (up to tens of MiB: small and mid-sized caches) in VMEM for the scatter of
its few new elements, then copies it back for the attention kernel, which reads it in HBM: two whole-array
copies per layer per step (the compiled-step audit of ``scripts/checks/check_tpu_compile.py`` finds them). Operands of
a ``pallas_call`` can be pinned to HBM (``pltpu.with_memory_space_constraint``); other XLA ops cannot. Here the
array never leaves HBM and only the touched rows move.

How: each new token's scales (``[2 * num_kv_heads]``, column ``(2 h + kv) * page_size + offset`` of its page's
row, :mod:`.kv_quant`) are first merged per page on small ``[tokens, width]`` arrays (tokens of one page land in
one row, exactly: one value per column), so each touched page has one merged row, owned by its first token. The
kernel DMAs the owned rows in, keeps every column no token writes, and DMAs them back: distinct pages, so no two
DMAs touch one row. Tokens are processed in chunks of :data:`CHUNK` rows (a sequential grid) to bound VMEM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

CHUNK = 128  # merged rows per grid step: VMEM is 3 x CHUNK x row width x 4 bytes (rows, mask, buffer), doubled


def _kernel(
    dst_ref,  # SMEM [tokens] int32 (scalar prefetch): the page row merged row t goes to; -1: none
    rows_ref,  # VMEM [chunk, width] f32: merged new scales of this chunk's rows (zero where not written)
    mask_ref,  # VMEM [chunk, width] int32: 1 where a row's column is written
    sc_hbm,  # ANY [num_pages, width] f32: the scales (aliased with out_hbm)
    out_hbm,  # ANY [num_pages, width] f32
    buf,  # VMEM [chunk, width] f32 scratch: the owned rows as stored
    sem,  # DMA semaphores (2,): reads, writes
):
    chunk = buf.shape[0]
    base = pl.program_id(0) * chunk

    def each(fn):
        def body(r, carry):
            pl.when(dst_ref[base + r] >= 0)(functools.partial(fn, r))
            return carry

        jax.lax.fori_loop(0, chunk, body, 0)

    def read(r):
        return pltpu.make_async_copy(sc_hbm.at[pl.ds(dst_ref[base + r], 1)], buf.at[pl.ds(r, 1)], sem.at[0])

    def write(r):
        return pltpu.make_async_copy(buf.at[pl.ds(r, 1)], out_hbm.at[pl.ds(dst_ref[base + r], 1)], sem.at[1])

    each(lambda r: read(r).start())
    each(lambda r: read(r).wait())
    buf[...] = jnp.where(mask_ref[...] != 0, rows_ref[...], buf[...])  # rows without an owner are never written
    each(lambda r: write(r).start())
    each(lambda r: write(r).wait())


def merged_rows(
    page: jax.Array,  # [tokens] int32: the page each token's scales go to; outside [0, num_pages): none
    offset: jax.Array,  # [tokens] int32: the token's slot in its page
    values: jax.Array,  # [tokens, 2 * num_kv_heads] f32: scale of (head h, K/V kv) at column 2 h + kv
    num_pages: int,
    page_size: int,
    width: int,  # the scale row's width (>= 2 * num_kv_heads * page_size)
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dst ``[tokens]``, rows ``[tokens, width]``, mask ``[tokens, width]``): row ``t`` holds every new scale of
    token ``t``'s page when ``t`` is that page's first token (``dst[t]`` = the page), else nothing (-1). Tokens
    outside the cache share one run whose rows only collect zeros and are never written."""
    tokens, hk = values.shape
    valid = (page >= 0) & (page < num_pages)
    lane = jnp.arange(width, dtype=jnp.int32)[None, :]
    hit = valid[:, None] & (lane < hk * page_size) & (lane % page_size == offset[:, None])  # [T, width]
    spread = jnp.pad(jnp.repeat(values, page_size, axis=1), ((0, 0), (0, width - hk * page_size)))
    # The first token of each page (by a stable sort of the pages: no [T, T] comparison at large buckets).
    key = jnp.where(valid, page, num_pages)
    order = jnp.argsort(key, stable=True)
    ranks = jnp.arange(tokens, dtype=jnp.int32)
    run_start = jnp.concatenate([jnp.ones((1,), bool), key[order][1:] != key[order][:-1]])
    first = order[jax.lax.cummax(jnp.where(run_start, ranks, 0))]  # per sorted position: its run's first token
    owner = jnp.zeros((tokens,), jnp.int32).at[order].set(first.astype(jnp.int32))
    # One written value per column of a page: the sum of the zero-filled rows is exact.
    rows = jnp.zeros((tokens, width), jnp.float32).at[owner].add(jnp.where(hit, spread, 0.0))
    mask = jnp.zeros((tokens, width), jnp.int32).at[owner].max(hit.astype(jnp.int32))
    dst = jnp.where(valid & (owner == jnp.arange(tokens)), page, -1).astype(jnp.int32)
    return dst, rows, mask


def write_scales_tpu(
    scales: jax.Array,  # [num_pages, width] f32, width >= 2 * num_kv_heads * page_size
    page: jax.Array,  # [tokens] int32; outside [0, num_pages): write nothing
    offset: jax.Array,  # [tokens] int32
    values: jax.Array,  # [tokens, 2 * num_kv_heads] f32
    page_size: int,
    interpret: bool | pltpu.InterpretParams = False,
    chunk: int = CHUNK,
) -> jax.Array:
    """``scales`` with token ``t``'s scale of (head h, K/V kv) at ``[page[t], (2 h + kv) * page_size +
    offset[t]]``; nothing else changes. In place (aliased, in HBM) under a jit that donates ``scales``. Tokens
    must name distinct slots. ``chunk``: merged rows per grid step (a multiple of 8; tests use small ones)."""
    num_pages, width = scales.shape
    tokens = page.shape[0]
    padded = -(-tokens // chunk) * chunk
    pad = padded - tokens
    page = jnp.pad(page, (0, pad), constant_values=-1)
    offset = jnp.pad(offset, (0, pad))
    values = jnp.pad(values.astype(jnp.float32), ((0, pad), (0, 0)))
    dst, rows, mask = merged_rows(page, offset, values, num_pages, page_size, width)
    block = pl.BlockSpec((chunk, width), lambda i, dst: (i, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    if not interpret:
        scales = pltpu.with_memory_space_constraint(scales, pltpu.HBM)
    return pl.pallas_call(
        _kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(padded // chunk,),
            in_specs=[block, block, any_spec],
            out_specs=any_spec,
            scratch_shapes=[pltpu.VMEM((chunk, width), jnp.float32), pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=jax.ShapeDtypeStruct(scales.shape, scales.dtype),
        input_output_aliases={3: 0},  # scales (after dst, rows, mask) -> out
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="write_kv_scales_tpu",
    )(dst, rows, mask, scales)
