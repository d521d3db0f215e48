"""How does a layer attend over paged KV? The model's attention seam: one step's metadata and the function that
writes the step's K/V into the pages and runs the ragged paged attention kernel.

The KV cache is one page array per layer, `[num_pages, num_kv_heads, page_size, 2 * head_dim]` (K then V of a
head along the last axis; see `pallas_kernels.common`). A scanned decoder (`paged_jax.model.scan`) keeps all
layers in one array `[num_layers * num_pages, ...]` (layer l's page p at `l * num_pages + p`); the block tables
and slot mappings name pages of one layer and each layer's attention call adds its offset.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax

import pallas_kernels
from paged_jax.model.attention import LayerPages


@flax.struct.dataclass
class PagedMeta:
    """Per-step attention metadata shared by all layers (see `pallas_kernels.ragged_paged_attention`)."""

    slot_mapping: jax.Array  # [T] i32 physical slot of each new token; -1 for padding tokens
    kv_lens: jax.Array  # [S] i32 keys per sequence after this step (0 for padding sequences)
    block_tables: jax.Array  # [S, max_blocks] i32 physical page of each logical block (0 = null page)
    cu_q_lens: jax.Array  # [S + 1] i32 cumulative query counts
    num_seqs: jax.Array  # [1] i32


def paged_attention(
    q,
    k,
    v,
    kv_pages,
    meta: PagedMeta,
    *,
    sm_scale: float,
    backend: str,
    sliding_window: int | None,
    soft_cap: float | None = None,
):
    """The model's `AttentionFn` over paged KV: write this step's K/V into pages, then attend.

    The model passes each layer's `sliding_window` and `soft_cap` (the config's window is only the default).
    `kv_pages`: one layer's pages, or a scanned decoder's `LayerPages` view of the stacked pages (the layer's
    page offset is then applied by the write and inside the attention call, so no layer is sliced out)."""
    view, offset = None, None
    if isinstance(kv_pages, LayerPages):
        view, kv_pages = kv_pages, kv_pages.pages
        offset = pallas_kernels.stacked_page_offset(kv_pages, view.layer, view.num_layers)
    resolved = pallas_kernels.resolve_backend(backend)
    writer = resolved if resolved in ("pallas-tpu", "pallas-tpu-interpret") else "xla"  # scales kept in TPU HBM
    kv_pages = pallas_kernels.write_kv(kv_pages, k, v, meta.slot_mapping, offset, writer)
    out = pallas_kernels.ragged_paged_attention(
        q,
        kv_pages,
        meta.kv_lens,
        meta.block_tables,
        meta.cu_q_lens,
        meta.num_seqs,
        offset,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        backend=backend,
    )
    return out, kv_pages if view is None else dataclasses.replace(view, pages=kv_pages)
