"""Writing new K/V into the pages, and copying pages (the KV manager's copy-on-write).

Both are single XLA scatters on the page array itself (no reshape, so no relayout on TPU), so under a ``jit``
that donates ``kv_pages`` they update the buffer in place: the cost is proportional to what is written, not to
the size of the cache. Layout: see :mod:`.common`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import kv_dims


def write_kv(
    kv_pages: jax.Array,  # [num_pages, num_kv_heads, page_size, 2 * head_dim]
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # [num_tokens] int32, slot = page * page_size + offset; negative: padding
) -> jax.Array:
    """Returns ``kv_pages`` with token ``t``'s K/V at slot ``slot_mapping[t]``; negative slots write nothing.

    Slots must be distinct (one physical slot per new token). In place when the caller's jit donates
    ``kv_pages``: one scatter of ``[num_kv_heads, 2 * head_dim]`` rows indexed by (page, offset).
    """
    num_pages, num_kv_heads, page_size, head_dim = kv_dims(kv_pages)
    if k.shape != v.shape or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"k and v must be [num_tokens, {num_kv_heads}, {head_dim}], got {k.shape}, {v.shape}")
    if slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {slot_mapping.shape}")
    new = jnp.concatenate([k, v], axis=-1).astype(kv_pages.dtype)  # [num_tokens, num_kv_heads, 2 * head_dim]
    # Negative slots get an out-of-bounds page, which mode="drop" skips (no wrap-around to the end).
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)
    offset = jnp.where(slot_mapping < 0, 0, slot_mapping % page_size)
    return kv_pages.at[page, :, offset].set(new, mode="drop", unique_indices=False)


def copy_pages(
    kv_pages: jax.Array,  # [num_pages, num_kv_heads, page_size, 2 * head_dim]
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
