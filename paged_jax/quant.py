"""Quantization: which KV page dtype a run stores and what a token of it costs; int8/fp8 weights.

KV pages: ``--kv-dtype`` int8 or fp8_e4m3 stores :class:`pallas_kernels.kv_quant.QuantizedPages` (values plus one
float32 scale per token, KV head and K/V; see that module for the layout and why). Weights: see
:func:`quantize_params` below.
"""

from __future__ import annotations

import jax.numpy as jnp

from paged_jax.config import ModelConfig
from pallas_kernels import kv_quant

KV_DTYPE_CHOICES = ("float32", "bfloat16", *kv_quant.KV_QUANT_DTYPES)


def kv_cache_dtype(name: str | None, model_dtype) -> jnp.dtype:
    """The stored page dtype for ``--kv-dtype`` ``name`` (None: the model's dtype)."""
    if name is not None and name not in KV_DTYPE_CHOICES:
        raise ValueError(f"kv_dtype: must be one of {KV_DTYPE_CHOICES}, got {name!r}")
    return kv_quant.kv_dtype_from_name(name, model_dtype)


def kv_bytes_per_token(config: ModelConfig, kv_dtype) -> int:
    """Bytes of KV one token takes over all layers and KV heads, scales included."""
    return config.num_layers * config.num_kv_heads * kv_quant.bytes_per_token_head(config.head_dim, kv_dtype)


def kv_token_gain(config: ModelConfig, kv_dtype) -> float:
    """Tokens that fit a byte budget with ``kv_dtype`` pages, relative to bfloat16 pages (int8: ~1.94x)."""
    return kv_bytes_per_token(config, jnp.bfloat16) / kv_bytes_per_token(config, kv_dtype)
