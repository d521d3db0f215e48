"""Block sizes for the TPU ragged paged-attention kernel, per TPU generation, with a heuristic fallback.

A block size is ``(q_tokens_per_block, kv_slots_per_block)``: how many flat query tokens one grid step owns,
and how many KV slots (``pages_per_block * page_size``) one DMA'd compute block holds.

The table entries are starting points derived from each generation's VMEM and MXU shape, not yet measured on
hardware (no TPU was at hand when they were written); replace them with timings from a sweep on the device.
The fallback (:func:`heuristic_block_sizes`) works anywhere, including off-device and for AOT compiles.
"""

from __future__ import annotations

import jax

# (generation, kv dtype, head_dim) -> (q_tokens_per_block, kv_slots_per_block)
TUNED_BLOCK_SIZES: dict[tuple[str, str, int], tuple[int, int]] = {
    # v5e: 4x 128x128 MXUs, 128 MiB VMEM (16 MiB scoped by default).
    ("v5e", "bfloat16", 64): (32, 512),
    ("v5e", "bfloat16", 128): (32, 256),
    ("v5e", "bfloat16", 256): (32, 128),
    ("v5e", "float32", 64): (32, 256),
    ("v5e", "float32", 128): (32, 128),
    ("v5e", "float32", 256): (16, 128),
    # v6e: 256x256 MXUs, 128 MiB VMEM (32 MiB scoped by default): longer KV blocks per step.
    ("v6e", "bfloat16", 64): (32, 1024),
    ("v6e", "bfloat16", 128): (32, 512),
    ("v6e", "bfloat16", 256): (32, 256),
    ("v6e", "float32", 64): (32, 512),
    ("v6e", "float32", 128): (32, 256),
    ("v6e", "float32", 256): (16, 256),
}

# Budget for the two KV buffers of one grid step when nothing better is known.
_KV_BUFFER_BYTES = 4 * 1024 * 1024


def tpu_generation(device_kind: str | None = None) -> str | None:
    """``"v5e"``, ``"v6e"``, ``"v5p"``, ``"v4"``, ... from a device kind string, or None when not on a TPU."""
    if device_kind is None:
        dev = jax.devices()[0]
        if dev.platform != "tpu":
            return None
        device_kind = dev.device_kind
    kind = device_kind.lower().replace("tpu", "").strip()
    if "lite" in kind or kind.endswith("e"):
        return f"v{kind.lstrip('v').split()[0].rstrip('e')}e"
    return kind.replace(" ", "")


def heuristic_block_sizes(
    num_tokens: int, page_size: int, num_kv_heads: int, head_dim: int, itemsize: int
) -> tuple[int, int]:
    """Block sizes from first principles: fill the MXU, keep both KV buffers within a few MiB of VMEM."""
    q_block = min(num_tokens, 32)
    slot_bytes = 2 * num_kv_heads * head_dim * itemsize  # one KV slot of all heads
    slots = max(page_size, min(512, _KV_BUFFER_BYTES // (2 * slot_bytes)))
    return q_block, slots


def get_block_sizes(
    num_tokens: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype,
    max_blocks_per_seq: int,
    generation: str | None = None,
) -> tuple[int, int]:
    """``(q_tokens_per_block, pages_per_block)`` for one bucket shape, valid for the kernel's constraints."""
    itemsize = jax.numpy.dtype(dtype).itemsize
    if generation is None:
        generation = tpu_generation()
    key = (generation, jax.numpy.dtype(dtype).name, head_dim)
    q_block, slots = TUNED_BLOCK_SIZES.get(key) or heuristic_block_sizes(
        num_tokens, page_size, num_kv_heads, head_dim, itemsize
    )
    # The KV buffers hold all KV heads: shrink for wide models so two buffers stay within budget.
    while slots > page_size and 2 * slots * 2 * num_kv_heads * head_dim * itemsize > 4 * _KV_BUFFER_BYTES:
        slots //= 2
    pages_per_block = max(1, min(slots // page_size, max_blocks_per_seq))
    # Sublane tiling: 8 rows for 32-bit, 16 for bf16 (packed), and the token axis is a power of two >= 16.
    q_block = max(16, min(q_block, num_tokens))
    return q_block, pages_per_block
