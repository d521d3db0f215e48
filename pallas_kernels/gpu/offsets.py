"""64-bit pointer offsets for every Pallas Triton array of more than 2^31 elements.

jax 0.11.2's Triton lowering (``jax._src.pallas.triton.lowering._compute_offsets_from_indices``) computes a
load's or store's offsets from the array's base pointer in 64 bits only when the array exceeds 2^32 *bytes*. The
offsets count *elements* and are signed, so an array of 1-byte elements (int8 or fp8_e4m3 KV pages) between
2^31 and 2^32 bytes gets 32-bit offsets that wrap past element 2^31: at the engine's default sizing on an H200,
the per-layer int8/fp8 page arrays of most shipped configs are 2.7-4.2 GB, so the top pages would be read from
(and written to) the wrong place, only once the cache fills. Arrays of 2-byte and wider elements are unaffected
(2^32 bytes is at most 2^31 of them).

:func:`install` wraps that lowering function so the decision is by element count: an array of more than 2^31
elements is lowered as if it were 4 bytes wide for that one decision (its offsets become i64; nothing else of
the lowering reads that width). Arrays the original rule already handles keep their lowering exactly. The GPU
kernel installs it at import; ``tests/kernels/gpu/test_kernels_gpu.py`` lowers the kernel at real int8/fp8/bf16
sizes and checks the offset width of every pointer addition in the Triton IR, so a jax upgrade that changes the
rule (or fixes it) shows up there.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from jax._src.pallas.triton import lowering as _triton_lowering

MAX_I32_OFFSET_ELEMENTS = 2**31  # elements 0 .. 2^31 - 1 are addressable by a signed 32-bit offset


def needs_i64_offsets(shape: tuple[int, ...]) -> bool:
    """Whether an array of ``shape`` has elements past the reach of a signed 32-bit offset."""
    return math.prod(shape) > MAX_I32_OFFSET_ELEMENTS


def _by_elements(original):
    @functools.wraps(original)
    def compute_offsets(block_info, nd_indexer):
        aval = block_info.full_shape_dtype
        if needs_i64_offsets(aval.shape) and np.dtype(aval.dtype).itemsize < 4:
            # The original rule widens on bytes > 2^32; at 4 bytes per element that is elements > 2^30.
            wide = aval.update(dtype=np.dtype(np.float32))
            block_info = type(block_info)(
                full_shape_dtype=wide,
                start_indices=block_info.start_indices,
                start_indices_alignment=block_info.start_indices_alignment,
                block_shape=block_info.block_shape,
            )
        return original(block_info, nd_indexer)

    compute_offsets.__dict__["paged_jax_by_elements"] = True  # marks the rule as ours (a function attribute)
    return compute_offsets


def install() -> None:
    """Make the Triton lowering pick 64-bit offsets by element count (idempotent)."""
    current = _triton_lowering._compute_offsets_from_indices
    if not getattr(current, "paged_jax_by_elements", False):
        _triton_lowering._compute_offsets_from_indices = _by_elements(current)
