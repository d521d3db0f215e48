"""Block sizes for the TPU ragged paged-attention kernel, per TPU generation, with a heuristic fallback.

A block-size triple is ``(decode_kv_slots, prefill_tokens, prefill_kv_slots)``: how many KV slots
(``pages_per_block * page_size``) one DMA'd block of a decode item holds, how many query tokens one prefill
item owns, and the KV slots of a prefill block. The plan (:mod:`pallas_kernels.tpu.plan`) turns them into pages and
shrinks
the prefill item to its VMEM budget.

How the entries were chosen (not yet measured on hardware: no TPU has been lent to this project). Decode is
bandwidth-bound: a block must be large enough that its DMA (``slots * 2 * heads * head_dim`` bytes) amortises
the ~1 us of per-step and per-DMA overhead against 819 GB/s (v5e) or 1.6 TB/s (v6e), i.e. >= 256 KiB, and two
of them must sit comfortably in scoped VMEM. Prefill is MXU-bound: ``group * tokens`` rows of >= 512 fill
the 128x128 (v5e) or 256x256 (v6e) MXU, and long items stream the chunk's KV fewer times (KV bytes are
``cdiv(chunk, tokens)`` x the context); but an item longer than the chunk computes padding rows (a 256-token
chunk in a 512-token item issued 2.3x the useful FLOPs for SmolLM2), so 256 tokens everywhere: a 512-token
chunk then reads its KV twice (the issue's bound is 2x), a 256-token chunk once. Replace them with a sweep on
the device (``scripts/bench/bench_kernels.py``).
"""

from __future__ import annotations

import jax

# (generation, kv dtype, head_dim) -> (decode_kv_slots, prefill_tokens, prefill_kv_slots)
TUNED_BLOCK_SIZES: dict[tuple[str, str, int], tuple[int, int, int]] = {
    ("v5e", "bfloat16", 64): (512, 256, 256),
    ("v5e", "bfloat16", 128): (256, 256, 256),
    ("v5e", "bfloat16", 256): (128, 256, 128),
    ("v5e", "float32", 64): (256, 256, 256),
    ("v5e", "float32", 128): (128, 256, 128),
    ("v5e", "float32", 256): (128, 128, 128),
    ("v6e", "bfloat16", 64): (1024, 256, 512),
    ("v6e", "bfloat16", 128): (512, 256, 256),
    ("v6e", "bfloat16", 256): (256, 256, 256),
    ("v6e", "float32", 64): (512, 256, 256),
    ("v6e", "float32", 128): (256, 256, 256),
    ("v6e", "float32", 256): (128, 256, 128),
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


def heuristic_block_sizes(num_kv_heads: int, head_dim: int, itemsize: int) -> tuple[int, int, int]:
    """Block sizes from first principles: two KV buffers within a few MiB, 256-token prefill items."""
    slot_bytes = 2 * num_kv_heads * head_dim * itemsize  # one KV slot of all heads
    slots = max(16, min(512, _KV_BUFFER_BYTES // (2 * slot_bytes)))
    return slots, 256, slots


def get_block_sizes(num_kv_heads: int, head_dim: int, dtype, generation: str | None = None) -> tuple[int, int, int]:
    """``(decode_kv_slots, prefill_tokens, prefill_kv_slots)`` for one model shape and TPU generation."""
    itemsize = jax.numpy.dtype(dtype).itemsize
    if generation is None:
        generation = tpu_generation()
    key = (generation or "", jax.numpy.dtype(dtype).name, head_dim)  # off a TPU: "" matches no entry
    dec, tokens, pre = TUNED_BLOCK_SIZES.get(key) or heuristic_block_sizes(num_kv_heads, head_dim, itemsize)
    # The KV buffers hold all KV heads: shrink for wide models so two buffers stay within budget.
    budget = lambda slots: 2 * slots * 2 * num_kv_heads * head_dim * itemsize <= 4 * _KV_BUFFER_BYTES
    while dec > 16 and not budget(dec):
        dec //= 2
    while pre > 16 and not budget(pre):
        pre //= 2
    return dec, tokens, pre
