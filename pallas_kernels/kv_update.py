"""Writing new K/V into the pages, and copying pages (the KV manager's copy-on-write).

Both are single XLA scatters on the page array itself (no reshape, so no relayout on TPU), so under a ``jit``
that donates ``kv_pages`` they update the buffer in place: the cost is proportional to what is written, not to
the size of the cache. Layout: see :mod:`.common`. Quantized caches (:class:`.kv_quant.QuantizedPages`) are
written the same way: each new row is quantized with its own scale (:mod:`.kv_quant`), the values go into the
pages and the scales into the scale rows with a second scatter, so nothing already in a page is read or
rewritten; a page copy copies its scale row with it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant
from pallas_kernels.common import kv_dims


def write_kv(
    kv_pages,  # [num_pages, num_kv_heads, page_size, 2 * head_dim], or QuantizedPages of that layout
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # [num_tokens] int32, slot = page * page_size + offset; negative: padding
    page_offset: jax.Array | None = None,  # int32 scalar added to every page id (one layer of a stacked cache)
    scale_writer: str = "xla",
):
    """Returns ``kv_pages`` with token ``t``'s K/V at slot ``slot_mapping[t]``; negative slots write nothing.

    ``page_offset``: the slots name pages ``page_offset + page`` of ``kv_pages`` (layer ``l`` of a cache stacked
    over layers, :func:`.stacked_page_offset`), written in place like any other page.

    Slots must be distinct (one physical slot per new token). In place when the caller's jit donates
    ``kv_pages``: one scatter of ``[num_kv_heads, 2 * head_dim]`` rows indexed by (page, offset), and for
    quantized pages the ``[num_kv_heads, 2]`` scales of each token written by ``scale_writer``: ``xla`` (one
    scatter), ``pallas-tpu`` (the TPU kernel that keeps the scale array in HBM, :mod:`pallas_kernels.tpu.scale_write`)
    or
    ``pallas-tpu-interpret`` (that kernel in the interpreter).
    """
    pages, scales = kv_quant.split(kv_pages)
    num_pages, num_kv_heads, page_size, head_dim = kv_dims(pages)
    if k.shape != v.shape or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"k and v must be [num_tokens, {num_kv_heads}, {head_dim}], got {k.shape}, {v.shape}")
    if slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {slot_mapping.shape}")
    # Negative slots get an out-of-bounds page, which mode="drop" skips (no wrap-around to the end).
    page = slot_mapping // page_size + (0 if page_offset is None else page_offset)
    page = jnp.where(slot_mapping < 0, num_pages, page)
    offset = jnp.where(slot_mapping < 0, 0, slot_mapping % page_size)
    if scales is None:
        new = jnp.concatenate([k, v], axis=-1).astype(pages.dtype)  # [num_tokens, num_kv_heads, 2 * head_dim]
        heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :]
        return pages.at[page[:, None], heads, offset[:, None]].set(new, mode="drop", unique_indices=False)
    kq, ks = kv_quant.quantize(k, pages.dtype)  # [T, H, D], [T, H]
    vq, vs = kv_quant.quantize(v, pages.dtype)
    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :]
    new = jnp.concatenate([kq, vq], axis=-1)  # [num_tokens, num_kv_heads, 2 * head_dim]
    pages = pages.at[page[:, None], heads, offset[:, None]].set(new, mode="drop", unique_indices=False)
    # Scale of (head h, K/V kv, slot offset) at column (2 h + kv) * page_size + offset of the page's row.
    new_scales = jnp.stack([ks, vs], axis=-1)  # [T, H, 2]
    if scale_writer.startswith("pallas-tpu"):
        from pallas_kernels.tpu.scale_write import write_scales_tpu  # loaded only for TPU (as attention.py does)

        values = new_scales.reshape(-1, 2 * num_kv_heads)
        interpret = scale_writer == "pallas-tpu-interpret"
        return kv_quant.QuantizedPages(pages, write_scales_tpu(scales, page, offset, values, page_size, interpret))
    if scale_writer != "xla":
        raise ValueError(f"scale_writer: must be xla, pallas-tpu or pallas-tpu-interpret, got {scale_writer!r}")
    hk = jnp.arange(2 * num_kv_heads, dtype=jnp.int32).reshape(num_kv_heads, 2)
    col = hk[None] * page_size + offset[:, None, None]  # [T, H, 2]
    scales = scales.at[page[:, None, None], col].set(new_scales, mode="drop", unique_indices=False)
    return kv_quant.QuantizedPages(pages, scales)


def copy_pages(
    kv_pages,  # [num_pages, num_kv_heads, page_size, 2 * head_dim], or QuantizedPages
    src: jax.Array,  # [n] int32 page ids
    dst: jax.Array,  # [n] int32 page ids; (0, 0) pairs are padding
):
    """Returns ``kv_pages`` with page ``dst[i]`` replaced by (old) page ``src[i]`` (its scales too); in place
    under donation.

    All sources are read before any destination is written. Destinations other than the null page 0 must be
    distinct, and a destination should not be a source of the same call.
    """
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"src and dst must be equal [n] arrays, got {src.shape}, {dst.shape}")
    if isinstance(kv_pages, kv_quant.QuantizedPages):
        return kv_quant.QuantizedPages(*(x.at[dst].set(x[src], mode="drop") for x in kv_pages))
    return kv_pages.at[dst].set(kv_pages[src], mode="drop")


def stacked_page_offset(kv_pages, layer: jax.Array | int, num_layers: int) -> jax.Array:
    """The id of layer ``layer``'s first page in a cache of ``num_layers`` layers stacked on the page axis
    (``[num_layers * P, ...]``, layer ``l``'s page ``p`` at ``l * P + p``); int32 scalar."""
    pages, _ = kv_quant.split(kv_pages)
    if pages.shape[0] % num_layers:
        raise ValueError(f"stacked pages: {pages.shape[0]} pages do not split into {num_layers} layers")
    return jnp.asarray(layer, jnp.int32) * (pages.shape[0] // num_layers)


def copy_stacked_pages(kv_pages, src: jax.Array, dst: jax.Array, num_layers: int):
    """:func:`copy_pages` of pages ``src -> dst`` in every layer of a stacked cache (one scatter for all
    layers; in place under donation)."""
    base = stacked_page_offset(kv_pages, 1, num_layers) * jnp.arange(num_layers, dtype=jnp.int32)[:, None]
    return copy_pages(kv_pages, (base + src[None]).reshape(-1), (base + dst[None]).reshape(-1))
