"""The one entry point, :func:`ragged_paged_attention`, and its choice of backend."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import common, kv_quant
from pallas_kernels.cpu import paged as cpu_paged
from pallas_kernels.xla.paged import xla_ragged_paged_attention


def resolve_backend(backend: str, platform: str | None = None) -> str:
    """Maps a backend request to ``xla``, ``cpu``, ``pallas-tpu[-interpret]`` or ``pallas-gpu[-interpret]``.

    ``auto`` picks by platform (tpu: the Mosaic kernel, gpu: the Triton kernel, cpu: the C++ kernel of
    :mod:`pallas_kernels.cpu.paged` when it builds on this machine, else XLA). ``pallas`` is the
    platform's Pallas kernel; ``pallas-interpret`` is that kernel in interpret mode, and on CPU it means the
    TPU kernel (the one whose DMAs and semaphores the interpreter simulates).
    """
    platform = platform or jax.default_backend()
    if backend == "auto":
        if platform == "cpu":
            return "cpu" if cpu_paged.available() else "xla"
        return {"tpu": "pallas-tpu", "gpu": "pallas-gpu"}.get(platform, "xla")
    if backend == "cpu" and platform != "cpu":
        raise ValueError(f"backend='cpu' is the CPU kernel; this platform is {platform} (use 'auto')")
    if backend == "pallas":
        if platform not in ("tpu", "gpu"):
            raise ValueError(f"backend='pallas' needs a TPU or GPU, not {platform}; use 'pallas-interpret'")
        return f"pallas-{platform}"
    if backend == "pallas-interpret":
        return "pallas-gpu-interpret" if platform == "gpu" else "pallas-tpu-interpret"
    return backend


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "backend"))
def ragged_paged_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    kv_pages,  # [num_pages, num_kv_heads, page_size, 2 * head_dim], or kv_quant.QuantizedPages
    kv_lens: jax.Array,  # [max_seqs] int32
    block_tables: jax.Array,  # [max_seqs, max_blocks_per_seq] int32
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32
    num_seqs: jax.Array,  # [1] int32
    page_offset: jax.Array | None = None,  # int32 scalar: the block tables name pages page_offset + id
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    backend: str = "auto",
) -> jax.Array:
    """Causal attention of a ragged batch of sequences over paged KV; ``[num_tokens, num_q_heads, head_dim]``.

    Layout, masking (causal, sliding window ``x - w < p <= x``) and soft cap: see
    :mod:`pallas_kernels.common`. ``backend``: ``auto`` (by platform), ``xla``, ``pallas`` (the platform's
    kernel), ``pallas-interpret`` (that kernel in interpret mode; the TPU kernel on CPU), or
    explicitly ``pallas-tpu``, ``pallas-gpu``, ``pallas-tpu-interpret``, ``pallas-gpu-interpret``.
    Rows of padding tokens are zeros. Quantized pages (int8, fp8_e4m3) come as
    :class:`pallas_kernels.kv_quant.QuantizedPages`; every backend applies their scales on the fly.

    ``page_offset``: ``kv_pages`` is a cache stacked over layers (``[num_layers * P, ...]``,
    :func:`pallas_kernels.kv_update.stacked_page_offset`) and this call attends over the layer whose pages start
    at ``page_offset``: the offset is added to the block table (``[max_seqs, max_blocks]`` int32, a few KiB), so
    every backend reads that layer's pages where they lie in the stacked array and no layer is sliced out.
    """
    kv_pages, kv_scales = kv_quant.split(kv_pages)
    kv_quant.validate_scales(kv_pages, kv_scales)
    common.validate_static(
        q,
        kv_pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        backend=backend,
    )
    if page_offset is not None:
        block_tables = block_tables + jnp.asarray(page_offset, block_tables.dtype)
    args = (q, kv_pages, kv_lens, block_tables, cu_q_lens, num_seqs)
    opts: dict[str, Any] = dict(
        sm_scale=float(sm_scale), soft_cap=soft_cap, sliding_window=sliding_window, kv_scales=kv_scales
    )
    concrete = resolve_backend(backend)
    if concrete == "cpu" and cpu_paged.available() and cpu_paged.supports(q, kv_pages, kv_scales):
        return cpu_paged.cpu_ragged_paged_attention(*args, **opts)
    if concrete in ("xla", "cpu"):
        return xla_ragged_paged_attention(*args, **opts)
    if concrete.startswith("pallas-tpu"):
        from pallas_kernels.tpu.ragged_paged_attention import ragged_paged_attention_tpu

        return ragged_paged_attention_tpu(*args, **opts, interpret=concrete.endswith("interpret"))
    from pallas_kernels.gpu.ragged_paged_attention import ragged_paged_attention_gpu

    return ragged_paged_attention_gpu(*args, **opts, interpret=concrete.endswith("interpret"))
