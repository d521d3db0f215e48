"""Writing new K/V into the pages, and copying pages (the KV manager's copy-on-write).

Both are single XLA scatters on a reshaped view of the page array (a reshape of a contiguous array is free),
so under a ``jit`` that donates ``kv_pages`` they update the buffer in place: the cost is proportional to what
is written, not to the size of the cache. A Pallas kernel would add nothing here: the scatter is already one
bandwidth-bound pass over the new rows. Layout: see :mod:`.common`."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv(
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # [num_tokens] int32, slot = page * page_size + offset; negative: padding
) -> jax.Array:
    """Returns ``kv_pages`` with token ``t``'s K/V at slot ``slot_mapping[t]``; negative slots write nothing.

    Slots must be distinct (one physical slot per new token). In place when the caller's jit donates
    ``kv_pages``.
    """
    num_pages, page_size, kv_heads_x2, head_dim = kv_pages.shape
    if k.shape != v.shape or k.shape[1:] != (kv_heads_x2 // 2, head_dim):
        raise ValueError(
            f"k and v must be [num_tokens, {kv_heads_x2 // 2}, {head_dim}], got {k.shape}, {v.shape}"
        )
    if slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {slot_mapping.shape}")
    num_slots = num_pages * page_size
    # K of head h at 2h, V at 2h + 1.
    new = jnp.stack([k, v], axis=2).reshape(k.shape[0], kv_heads_x2, head_dim).astype(kv_pages.dtype)
    # Negative slots become out of bounds, which mode="drop" skips (no wrap-around to the end of the array).
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)
    flat = kv_pages.reshape(num_slots, kv_heads_x2, head_dim)
    flat = flat.at[slots].set(new, mode="drop", unique_indices=False)
    return flat.reshape(kv_pages.shape)


def copy_pages(
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    src: jax.Array,  # [n] int32 page ids
    dst: jax.Array,  # [n] int32 page ids; (0, 0) pairs are padding
) -> jax.Array:
    """Returns ``kv_pages`` with page ``dst[i]`` replaced by (old) page ``src[i]``; in place under donation.

    All sources are read before any destination is written. Destinations other than the null page 0 must be
    distinct, and a destination should not be a source of the same call.
    """
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"src and dst must be equal [n] arrays, got {src.shape}, {dst.shape}")
    return kv_pages.at[dst].set(kv_pages[src], mode="drop")
