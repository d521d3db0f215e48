"""Planning pieces both Pallas kernels share: which sequence owns each work item, which KV blocks it sees.

A kernel cuts the ragged batch (``cu_q_lens [max_seqs + 1]``, the real count ``num_seqs``) into work items of
consecutive query tokens of one sequence: sequence ``s`` contributes ``counts[s]`` items, and the items of all
sequences are concatenated in sequence order (:func:`sequence_items`). An item whose first query sits at
position ``first_pos`` and which holds ``n`` queries sees the KV blocks ``[b_lo, b_hi)`` of
:func:`visible_kv_blocks` (the masking convention of :mod:`.common`). The TPU plan
(:mod:`pallas_kernels.tpu.plan`) and the GPU plan (:mod:`pallas_kernels.gpu.plan`) build their work lists and KV
ranges from these, in
their wrappers, in their kernels and in their work models alike.

Everything here works for ``numpy`` and ``jax.numpy`` (``xp``); :func:`visible_kv_blocks` also on Python ints
and on scalars read inside a kernel.
"""

from __future__ import annotations

import numpy as np


def query_lens(xp, cu_q_lens, num_seqs):
    """``[max_seqs]`` int32 query tokens per sequence, 0 for the padding sequences past ``num_seqs``."""
    max_seqs = cu_q_lens.shape[0] - 1
    real = xp.arange(max_seqs, dtype=np.int32) < num_seqs
    return xp.where(real, cu_q_lens[1:] - cu_q_lens[:-1], 0).astype(np.int32)


def sequence_items(xp, counts, num_items: int):
    """The owner of each of ``num_items`` work items when sequence ``s`` has ``counts[s]`` (``[max_seqs]``) of them.

    Returns int32 ``seq`` (the owning sequence, clamped to a valid index past the real items), ``k`` (the item's
    index within its sequence) and bool ``real`` (item index below the total), each ``[num_items]``."""
    max_seqs = counts.shape[0]
    ends = xp.cumsum(counts).astype(np.int32)  # items up to and including each sequence
    j = xp.arange(num_items, dtype=np.int32)
    seq = xp.clip(xp.searchsorted(ends, j, side="right"), 0, max_seqs - 1).astype(np.int32)
    k = j - (ends[seq] - counts[seq])
    return seq, k, j < ends[-1]


def visible_kv_blocks(first_pos, n, kv_block: int, sliding_window: int | None):
    """``(first_key, b_lo, b_hi)``: the first key position the item's queries see and its KV blocks ``[b_lo, b_hi)``
    of ``kv_block`` keys, for ``n >= 1`` queries at positions ``first_pos .. first_pos + n - 1``.

    ``first_key`` is 0 without a sliding window, else ``max(first_pos - sliding_window + 1, 0)`` (written as a
    product so Python ints, numpy and kernel scalars all take it)."""
    first_key = 0
    if sliding_window is not None:
        first_key = first_pos - sliding_window + 1
        first_key = first_key * (first_key > 0)
    return first_key, first_key // kv_block, (first_pos + n - 1) // kv_block + 1
