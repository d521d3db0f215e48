"""The attention seam between the model and however KV is stored.

The model computes q, k, v (RoPE already applied) for a flat batch of tokens and calls an
`AttentionFn` once per layer with that layer's KV-cache entry and one `meta` pytree shared by all
layers. The function returns the attention output and the layer's updated cache. The model never
looks inside either: the dense path below keeps no cache at all; the paged path of the engine
writes new K/V into pages and reads them back. A scanned decoder (`paged_jax.model.scan`) keeps one stacked
cache for all layers and hands each layer a `LayerPages` view of it (the stacked cache and the layer's index).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from pallas_kernels.common import MASK_VALUE  # finite, so max - max stays finite

AttentionFn = Callable[..., tuple[jax.Array, Any]]
"""fn(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], kv_cache, meta, *, sm_scale, sliding_window=None, soft_cap=None)
-> (out [T, Hq, D], kv_cache). `sliding_window` (tokens, per layer) and `soft_cap` (Gemma 2's logit cap) follow
`pallas_kernels.common`: key p is visible to the query at x when x - window < p <= x; scores become
cap * tanh(scores / cap) before the softmax."""


@flax.struct.dataclass
class LayerPages:
    """Layer `layer` of a cache stacked over `num_layers` layers: what a scanned decoder passes its layers.

    `pages`: the whole stacked cache, whatever the attention function keeps (the paged engine: pages
    `[num_layers * P, ...]`, layer l's pages at `l * P ...`); `layer`: int32 scalar, traced (the scan's index).
    The attention function indexes the stacked cache by layer itself, so no layer's slice is ever copied out,
    and returns the view with the updated stacked cache."""

    pages: Any
    layer: jax.Array
    num_layers: int = flax.struct.field(pytree_node=False)


@flax.struct.dataclass
class DenseMeta:
    """Metadata for `dense_attention` over flattened tokens of several sequences.

    segment_ids: [T] int32; a token attends only to tokens of its own segment; -1 marks padding.
    positions:   [T] int32; position of each token in its sequence; causal by position.
    """

    segment_ids: jax.Array
    positions: jax.Array

    @classmethod
    def single(cls, num_tokens: int, length: int | jax.Array | None = None) -> DenseMeta:
        """One sequence at positions 0..T-1; tokens at index >= `length` are padding."""
        idx = jnp.arange(num_tokens, dtype=jnp.int32)
        seg = jnp.zeros((num_tokens,), jnp.int32) if length is None else jnp.where(idx < length, 0, -1)
        return cls(segment_ids=seg.astype(jnp.int32), positions=idx)


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: Any,
    meta: DenseMeta,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[jax.Array, Any]:
    """Masked causal softmax attention in float32 within segments; the cache passes through untouched.

    With `sliding_window` w a query at position x sees keys at x - w < p <= x; with `soft_cap` c the scaled
    scores become c * tanh(scores / c) before masking (the order of `pallas_kernels.common`).

    q: [T, Hq, D]; k, v: [T, Hkv, D] with Hq a multiple of Hkv (GQA/MQA). Query head h reads KV head
    h // (Hq // Hkv), as HF's `repeat_kv` does; we reshape q to [T, Hkv, G, D] instead of copying KV.
    Returns (out [T, Hq, D] in q.dtype, kv_cache). Padding rows (segment -1) come out as zeros.
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qg = q.reshape(t, hkv, g, d).astype(jnp.float32)
    scores = jnp.einsum("qhgd,khd->hgqk", qg, k.astype(jnp.float32)) * sm_scale  # [Hkv, G, T, T]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    seg, pos = meta.segment_ids, meta.positions
    valid_q = seg >= 0
    mask = (seg[:, None] == seg[None, :]) & valid_q[:, None] & (pos[None, :] <= pos[:, None])  # [Tq, Tk]
    if sliding_window is not None:
        mask = mask & (pos[None, :] > pos[:, None] - sliding_window)
    scores = jnp.where(mask[None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("hgqk,khd->qhgd", probs, v.astype(jnp.float32))  # [T, Hkv, G, D]
    out = jnp.where(valid_q[:, None, None, None], out, 0.0)
    return out.reshape(t, hq, d).astype(q.dtype), kv_cache


__all__ = ["AttentionFn", "DenseMeta", "LayerPages", "MASK_VALUE", "dense_attention"]
