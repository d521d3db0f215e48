"""How does a layer attend over paged KV? The model's attention seam: one step's metadata and the function that
writes the step's K/V into the pages and runs the ragged paged attention kernel.

The KV cache is one page array per layer, `[num_pages, num_kv_heads, page_size, 2 * head_dim]` (K then V of a
head along the last axis; see `pallas_kernels.common`). A scanned decoder (`paged_jax.model.scan`) keeps all
layers in one array `[num_layers * num_pages, ...]` (layer l's page p at `l * num_pages + p`); the block tables
and slot mappings name pages of one layer and each layer's attention call adds its offset.

KV cache groups (`paged_jax.kv_cache.groups`, scanned decoder only): a page is `num_slabs` layer slabs, the stacked
array `[num_slabs * num_pages, ...]`, and the step carries one block table and one slot mapping per group
(`block_tables [G, S, max_blocks]`, `slot_mapping [G, T]`). Layer l reads row `group(l)` of both and slab `slab(l)`
of the pages (`GroupedPages`, constants indexed by the scan's traced layer index: a [S, max_blocks] slice per
layer, never a copy of pages).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import flax.struct
import jax
import jax.numpy as jnp

import pallas_kernels
from paged_jax.kv_cache import KVLayout
from paged_jax.model.attention import LayerPages
from paged_jax.model.linear_state import StateMeta


@dataclass(frozen=True, slots=True)
class GroupedPages:
    """How each layer of a model with several KV cache groups finds its pages (module docstring)."""

    layer_group: tuple[int, ...]  # per layer: its group, the row of `block_tables` / `slot_mapping` it reads
    layer_slab: tuple[int, ...]  # per layer: its slab of the group's pages
    num_slabs: int  # slabs per page: the stacked array is `num_slabs` blocks of `num_pages` pages

    @property
    def num_groups(self) -> int:
        return max(self.layer_group) + 1

    @classmethod
    def of(cls, layout: KVLayout, num_layers: int) -> GroupedPages | None:
        """The grouped view of `layout`; None for one group (the plain stacked cache, one table)."""
        if len(layout.groups) == 1:
            return None
        return cls(layout.group_of_layer(num_layers), layout.slot_of_layer(num_layers), layout.slots_per_page)


@flax.struct.dataclass
class PagedMeta:
    """Per-step attention metadata shared by all layers (see `pallas_kernels.ragged_paged_attention`)."""

    slot_mapping: jax.Array  # [T] i32 physical slot of each new token; -1 for padding tokens (groups: [G, T])
    kv_lens: jax.Array  # [S] i32 keys per sequence after this step (0 for padding sequences)
    block_tables: jax.Array  # [S, max_blocks] i32 physical page of each logical block, 0 = null page ([G, S, mb])
    cu_q_lens: jax.Array  # [S + 1] i32 cumulative query counts
    num_seqs: jax.Array  # [1] i32
    # linear-attention hybrids: which state slot each sequence reads and writes (`paged_jax.model.linear_state`)
    state: StateMeta | None = None


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
    grouped: GroupedPages | None = None,
):
    """The model's `AttentionFn` over paged KV: write this step's K/V into pages, then attend.

    The model passes each layer's `sliding_window` and `soft_cap` (the config's window is only the default).
    `kv_pages`: one layer's pages, or a scanned decoder's `LayerPages` view of the stacked pages (the layer's
    page offset is then applied by the write and inside the attention call, so no layer is sliced out).
    `grouped`: the layers' KV cache groups (module docstring), with a `LayerPages` view only."""
    view, offset = None, None
    slots, tables = meta.slot_mapping, meta.block_tables
    if isinstance(kv_pages, LayerPages):
        view, kv_pages = kv_pages, kv_pages.pages
        if grouped is None:
            offset = pallas_kernels.stacked_page_offset(kv_pages, view.layer, view.num_layers)
        else:
            group = jnp.asarray(grouped.layer_group, jnp.int32)[view.layer]
            slab = jnp.asarray(grouped.layer_slab, jnp.int32)[view.layer]
            offset = pallas_kernels.stacked_page_offset(kv_pages, slab, grouped.num_slabs)
            slots, tables = slots[group], tables[group]
    elif grouped is not None:
        raise ValueError("KV cache groups need the scanned decoder's stacked cache")
    resolved = pallas_kernels.resolve_backend(backend)
    writer = resolved if resolved in ("pallas-tpu", "pallas-tpu-interpret") else "xla"  # scales kept in TPU HBM
    kv_pages = pallas_kernels.write_kv(kv_pages, k, v, slots, offset, writer)
    out = pallas_kernels.ragged_paged_attention(
        q,
        kv_pages,
        meta.kv_lens,
        tables,
        meta.cu_q_lens,
        meta.num_seqs,
        offset,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        backend=backend,
    )
    return out, kv_pages if view is None else dataclasses.replace(view, pages=kv_pages)
