"""Paged attention for paged-jax: one ragged kernel for decode and (chunked) prefill, on TPU, GPU and CPU.

Layout of the pages and the masking conventions: :mod:`pallas_kernels.common`. Backends: the plain-XLA path
(:mod:`pallas_kernels.xla.paged`, also the CPU fast path), the Mosaic TPU kernel
(:mod:`pallas_kernels.tpu.ragged_paged_attention`) and
the Triton GPU kernel (:mod:`pallas_kernels.gpu.ragged_paged_attention`); :func:`ragged_paged_attention` picks one."""

from pallas_kernels.attention import ragged_paged_attention, resolve_backend
from pallas_kernels.common import MASK_VALUE
from pallas_kernels.kv_update import copy_pages, copy_stacked_pages, stacked_page_offset, write_kv
from pallas_kernels.reference import dense_reference_attention

__all__ = [
    "MASK_VALUE",
    "copy_pages",
    "copy_stacked_pages",
    "dense_reference_attention",
    "ragged_paged_attention",
    "resolve_backend",
    "stacked_page_offset",
    "write_kv",
]
