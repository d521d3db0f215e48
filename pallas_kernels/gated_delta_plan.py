"""The work lists of the gated delta rule kernels over a paged step, and what one call moves and computes.

A step is a ragged batch of sequences (``cu_q_lens [max_seqs + 1]``, ``num_seqs``; the attention kernels'
layout, :mod:`pallas_kernels.planning`), each continuing the state in its own row (``seq_slots [max_seqs]``) of
a state pool ``[num_slots, H, Dk, Dv]`` float32, or starting from zeros (``seq_fresh``). Two ranges, as the
attention kernels split decode from prefill:

- chunk items (:func:`chunk_items`): ``chunk`` (64) consecutive tokens of one sequence of two or more tokens,
  all chunks of a sequence in order. The first chunk of a sequence reads its row (or zeros), the last writes it.
- decode items (:func:`decode_items`): the single token of a one-token sequence (the recurrent form).

Item arrays are ``[num_items]`` int32, real items first, then padding items (``n == 0``). The TPU and GPU
kernels walk these lists; :func:`gated_delta_work` sums the bytes and FLOPs of the same lists for the work
model (:mod:`pallas_kernels.work_model`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from pallas_kernels.common import cdiv
from pallas_kernels.planning import query_lens, sequence_items
from pallas_kernels.work_model import KernelWork

CHUNK = 64  # tokens per chunk item (transformers' and flash-linear-attention's chunk size)
FIRST, LAST, FRESH = 1, 2, 4  # bits of Items.flags


class Items(NamedTuple):
    """One range's work list (module docstring); arrays of ``[num_items]`` int32 (numpy or jax)."""

    t0: Any  # first flat token of the item
    n: Any  # real tokens of the item (0: padding item)
    slot: Any  # the sequence's state row
    flags: Any  # FIRST (read the row, or zeros when FRESH), LAST (write the row)


@dataclasses.dataclass(frozen=True)
class GatedDeltaPlan:
    """Static shape of one call: the item bounds of both ranges (the grid sizes are the real counts)."""

    num_tokens: int
    max_seqs: int
    num_heads: int
    key_dim: int
    value_dim: int
    chunk: int
    chunk_items: int  # static bound on chunk items
    decode_items: int  # static bound on decode items


def plan_gated_delta(
    num_tokens: int, max_seqs: int, num_heads: int, key_dim: int, value_dim: int, chunk: int = CHUNK
) -> GatedDeltaPlan:
    """Bounds: a sequence of ``L >= 2`` tokens has ``cdiv(L, chunk)`` chunk items, so ``T`` tokens over at most
    ``min(max_seqs, T // 2)`` such sequences have at most ``cdiv(T, chunk) + min(max_seqs, T // 2)`` (and never
    more than ``T // 2``: every chunk item of them but one per sequence is full); decode items are at most
    ``min(max_seqs, T)``."""
    multi = min(max_seqs, num_tokens // 2)
    chunk_items = max(1, min(cdiv(num_tokens, chunk) + multi, num_tokens // 2))
    return GatedDeltaPlan(
        num_tokens, max_seqs, num_heads, key_dim, value_dim, chunk, chunk_items, max(1, min(max_seqs, num_tokens))
    )


def _flags(xp, first, last, fresh):
    return (xp.where(first, FIRST, 0) + xp.where(last, LAST, 0) + xp.where(first & fresh, FRESH, 0)).astype(np.int32)


def chunk_items(xp, plan: GatedDeltaPlan, cu_q_lens, num_seqs, seq_slots, seq_fresh) -> Items:
    """The chunk range's items: every sequence of two or more tokens in ``plan.chunk``-token pieces."""
    q_lens = query_lens(xp, cu_q_lens, num_seqs)
    counts = xp.where(q_lens > 1, (q_lens + plan.chunk - 1) // plan.chunk, 0).astype(np.int32)
    seq, k, real = sequence_items(xp, counts, plan.chunk_items)
    n = xp.where(real, xp.minimum(plan.chunk, q_lens[seq] - k * plan.chunk), 0).astype(np.int32)
    t0 = xp.where(real, cu_q_lens[seq] + k * plan.chunk, 0).astype(np.int32)
    flags = xp.where(real, _flags(xp, k == 0, k == counts[seq] - 1, seq_fresh[seq]), 0).astype(np.int32)
    return Items(t0, n, xp.where(real, seq_slots[seq], 0).astype(np.int32), flags)


def decode_items(xp, plan: GatedDeltaPlan, cu_q_lens, num_seqs, seq_slots, seq_fresh) -> Items:
    """The decode range's items: one per one-token sequence. Padding items point at token ``num_tokens`` (the
    kernels' spare row) and slot 0."""
    q_lens = query_lens(xp, cu_q_lens, num_seqs)
    seq, _, real = sequence_items(xp, (q_lens == 1).astype(np.int32), plan.decode_items)
    t0 = xp.where(real, cu_q_lens[seq], plan.num_tokens).astype(np.int32)
    flags = xp.where(real, _flags(xp, real, real, seq_fresh[seq]), 0).astype(np.int32)
    return Items(t0, real.astype(np.int32), xp.where(real, seq_slots[seq], 0).astype(np.int32), flags)


def _chunk_flops(h: int, dk: int, dv: int, rows: int, row_tile: int) -> int:
    """Issued FLOPs of one chunk item of ``rows`` window rows, per call of the kernel's per-head matmuls: the
    cumsum and row broadcast (``[R, R]``), ``Q K^T`` and ``K_beta K^T``, the ``diag(r) X`` scalings, the
    forward substitution (``rows`` products ``[1, R] x [R, R]``, M padded to ``row_tile``), the two products
    with the inverse, ``W S``, ``Q S``, ``A V_new`` and ``K^T V_new``."""
    r = rows
    return (
        2
        * h
        * (
            2 * r * r * r  # cumsum (M = 1, padded: counted as R rows), diag(cum) @ ones
            + r * r * 2 * dk  # Q K^T, K_beta K^T
            + r * r * (2 * dk + dv + dk)  # diag(beta) K, diag(beta) V, diag(e^cum) Q, diag(e^cum) K_beta
            + r * row_tile * r  # forward substitution
            + r * r * (dk + dv)  # inverse x (K_cumdecay, V_beta)
            + r * dk * dv * 3  # W S, Q S, K^T V_new
            + r * r * dv  # A V_new
            + r * r * dk  # diag(tail) K
        )
    )


def _row_bytes(h: int, dk: int, dv: int, itemsize: int) -> int:
    """q, k, v in ``itemsize``, g and beta in f32, the f32 output read and written: one token row."""
    return h * (2 * dk + dv) * itemsize + 2 * h * 4 + 2 * h * dv * 4


def chunk_static_work(plan: GatedDeltaPlan, itemsize: int, rows: int, row_tile: int = 8) -> KernelWork:
    """The chunk range's bound (every item full, every sequence read and written): the kernel's cost estimate."""
    h, dk, dv = plan.num_heads, plan.key_dim, plan.value_dim
    seqs = min(plan.max_seqs, plan.chunk_items)
    return KernelWork(
        kv_bytes_read=seqs * 2 * h * dk * dv * 4,
        q_bytes=plan.chunk_items * rows * _row_bytes(h, dk, dv, itemsize) // 2,
        out_bytes=plan.chunk_items * rows * _row_bytes(h, dk, dv, itemsize) // 2,
        issued_flops=plan.chunk_items * _chunk_flops(h, dk, dv, rows, row_tile),
        useful_flops=plan.chunk_items * 2 * h * plan.chunk * (plan.chunk * (2 * dk + dv) + 3 * dk * dv),
        exps=plan.chunk_items * h * rows * (rows + 2),
        programs=plan.chunk_items,
    )


def decode_static_work(plan: GatedDeltaPlan, itemsize: int, row_tile: int = 8) -> KernelWork:
    """The decode range's bound: every item real. The state row is read and written once per item."""
    h, dk, dv = plan.num_heads, plan.key_dim, plan.value_dim
    return KernelWork(
        kv_bytes_read=plan.decode_items * 2 * h * dk * dv * 4,
        q_bytes=plan.decode_items * (h * (2 * dk + dv) * itemsize + 2 * h * 4),
        out_bytes=plan.decode_items * h * dv * 4,
        issued_flops=plan.decode_items * 2 * h * 3 * row_tile * dk * dv,
        useful_flops=plan.decode_items * 2 * h * 3 * dk * dv,
        exps=0,
        programs=plan.decode_items,
    )


def gated_delta_work(
    plan: GatedDeltaPlan, cu_q_lens, num_seqs: int, itemsize: int, rows: int, row_tile: int = 8
) -> tuple[KernelWork, KernelWork]:
    """``(chunk_range, decode_range)`` work of one call with these sequence lengths (host numpy), over the
    same item lists the kernels walk: a chunk item moves its ``rows``-row window (the TPU kernel's chunk plus
    its alignment), every sequence's state row is read and written once (counted in ``kv_bytes_read``: the
    state is this kernel's cache); FLOPs as :func:`chunk_static_work` and :func:`decode_static_work`."""
    cu = np.asarray(cu_q_lens)
    slots = np.zeros(plan.max_seqs, np.int32)
    fresh = np.zeros(plan.max_seqs, bool)
    h, dk, dv, c = plan.num_heads, plan.key_dim, plan.value_dim, plan.chunk
    state = h * dk * dv * 4
    row = _row_bytes(h, dk, dv, itemsize)
    chunks = chunk_items(np, plan, cu, num_seqs, slots, fresh)
    real = chunks.n > 0
    n_chunk = int(real.sum())
    seqs_chunk = int((chunks.flags[real] & FIRST > 0).sum())
    useful = sum(2 * h * int(n) * (int(n) * (2 * dk + dv) + 3 * dk * dv) for n in chunks.n[real])
    chunk_work = KernelWork(
        kv_bytes_read=seqs_chunk * 2 * state,
        q_bytes=n_chunk * rows * row // 2,
        out_bytes=n_chunk * rows * row // 2,
        issued_flops=n_chunk * _chunk_flops(h, dk, dv, rows, row_tile),
        useful_flops=useful,
        exps=n_chunk * h * rows * (rows + 2),
        programs=n_chunk,
    )
    dec = decode_items(np, plan, cu, num_seqs, slots, fresh)
    n_dec = int((dec.n > 0).sum())
    per = decode_static_work(plan, itemsize, row_tile)
    scale = lambda x: x * n_dec // plan.decode_items
    decode_work = dataclasses.replace(
        per,
        kv_bytes_read=scale(per.kv_bytes_read),
        q_bytes=scale(per.q_bytes),
        out_bytes=scale(per.out_bytes),
        issued_flops=scale(per.issued_flops),
        useful_flops=scale(per.useful_flops),
        programs=n_dec,
    )
    del c
    return chunk_work, decode_work


__all__ = [
    "CHUNK",
    "FIRST",
    "FRESH",
    "LAST",
    "GatedDeltaPlan",
    "Items",
    "chunk_items",
    "chunk_static_work",
    "decode_items",
    "decode_static_work",
    "gated_delta_work",
    "plan_gated_delta",
]
