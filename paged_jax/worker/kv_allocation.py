"""Where do the KV pages live? The device page arrays of a runner, allocated zeroed in place (one per layer, or
one stacked array for the scanned decoder), or described abstractly for an ahead-of-time compile.

On one CPU device float pages are zeroed lazily (`pallas_kernels.cpu.zeros`: the OS supplies a zero page when
a page is first written), so start-up neither writes nor holds the whole cache; elsewhere they are `jnp.zeros`
on the device.

A page array is `[num_pages, num_kv_heads, page_size, 2 * head_dim]` (`pallas_kernels.common.kv_pages_shape`);
int8 / fp8 pages are `QuantizedPages` (values and per-row scales, `pallas_kernels.kv_quant`). With a mesh the
pages are split by KV heads (`paged_jax.worker.sharding.kv_sharding`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.config import ModelConfig
from paged_jax.worker import sharding
from pallas_kernels import kv_quant
from pallas_kernels.common import kv_pages_shape
from pallas_kernels.cpu import zeros as cpu_zeros


def scale_layout(platform: str, mesh: jax.sharding.Mesh | None) -> dict:
    """How quantized pages' scale rows are stored on `platform`: lane-dense on TPU, each TP shard's part of a row
    padded on its own (`pallas_kernels.kv_quant.scales_shape`)."""
    return {"dense": kv_quant.lane_dense(platform), "shards": 1 if mesh is None else mesh.shape[sharding.TP]}


def allocate_kv(
    config: ModelConfig, num_pages: int, page_size: int, kv_dtype, mesh: jax.sharding.Mesh | None, platform: str
):
    """A zeroed cache of `num_pages` pages (one layer's, or all layers' stacked): a page array, or
    `QuantizedPages` (values and scales, `scale_layout`) for int8 / fp8."""
    device = None if mesh is None else sharding.kv_sharding(mesh)
    if kv_quant.is_quantized_dtype(kv_dtype):
        scales_device = None if mesh is None else sharding.kv_scales_sharding(mesh)
        return kv_quant.allocate(
            num_pages,
            config.num_kv_heads,
            page_size,
            config.head_dim,
            kv_dtype,
            device,
            scales_device,
            **scale_layout(platform, mesh),
        )
    shape = kv_pages_shape(num_pages, config.num_kv_heads, page_size, config.head_dim)
    if platform == "cpu" and mesh is None:
        lazy = cpu_zeros.zeros(shape, kv_dtype)
        if lazy is not None:
            return lazy
    return jnp.zeros(shape, kv_dtype, device=device)


def abstract_kv(
    config: ModelConfig, num_pages: int, page_size: int, kv_dtype, mesh: jax.sharding.Mesh | None, one, platform: str
):
    """One layer's cache as `jax.ShapeDtypeStruct`s (nothing allocated): on `mesh` as `allocate_kv` places it, or
    on the single-device sharding `one`."""
    shape = kv_pages_shape(num_pages, config.num_kv_heads, page_size, config.head_dim)
    pages = jax.ShapeDtypeStruct(shape, kv_dtype, sharding=one if mesh is None else sharding.kv_sharding(mesh))
    if not kv_quant.is_quantized_dtype(kv_dtype):
        return pages
    scales_on = one if mesh is None else sharding.kv_scales_sharding(mesh)
    scales = kv_quant.scales_shape(num_pages, config.num_kv_heads, page_size, **scale_layout(platform, mesh))
    return kv_quant.QuantizedPages(pages, jax.ShapeDtypeStruct(scales, jnp.float32, sharding=scales_on))  # type: ignore[arg-type]  # abstract leaves stand in for arrays
