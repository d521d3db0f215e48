"""Flax Llama-style decoder (Llama 2/3, Mistral, Qwen2 shapes) over a flat batch of tokens.

Parameter tree (`{"params": ...}`), kernels stored [in, ...out] so no transpose happens per step:

    embed_tokens/embedding            [V, H]
    layers_{i}/input_layernorm/weight [H]
    layers_{i}/self_attn/qkv_proj     [H, Hkv, G + 2, D]   qkv_bias [Hkv, G + 2, D] (attention_bias only)
    layers_{i}/self_attn/o_proj       [Hq, D, H]
    layers_{i}/post_attention_layernorm/weight [H]
    layers_{i}/mlp/gate_up_proj       [H, 2, I];  down_proj [I, H]
    norm/weight                       [H]
    lm_head                           [H, V]         (absent when embeddings are tied)

q/k/v and gate/up are fused, one matmul each (G = Hq / Hkv query heads per KV head, grouped per KV head so
tensor parallelism keeps whole groups): `paged_jax.model.fuse` explains the layout and converts from the
one-kernel-per-projection layout that importers produce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from paged_jax import quant
from paged_jax.config import ModelConfig
from paged_jax.model.attention import AttentionFn, dense_attention
from paged_jax.model.layers import (
    MLP,
    RMSNorm,
    apply_rope,
    kernel_init,
    out_projection,
    qkv_projection,
    rope_cos_sin,
    rope_inv_freq,
)


class Attention(nn.Module):
    """QKV projection, RoPE, the pluggable attention function, output projection."""

    config: ModelConfig
    attention_fn: AttentionFn

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, kv_cache: Any, meta: Any) -> tuple[jax.Array, Any]:
        """x: [T, H]; cos, sin: [T, D] float32. Returns ([T, H], new kv_cache)."""
        c = self.config
        dtype = jnp.dtype(c.dtype)
        h, d, hq, hkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
        g = hq // hkv
        attn = {
            "qkv_proj": self.param("qkv_proj", kernel_init, (h, hkv, g + 2, d), dtype),
            "o_proj": self.param("o_proj", kernel_init, (hq, d, h), dtype),
        }
        if c.attention_bias:
            attn["qkv_bias"] = self.param("qkv_bias", nn.initializers.zeros, (hkv, g + 2, d), dtype)
        q, k, v = qkv_projection(x, attn, c)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        out, kv_cache = self.attention_fn(q, k, v, kv_cache, meta, sm_scale=d**-0.5, sliding_window=c.sliding_window)
        return out_projection(out, attn), kv_cache


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""

    config: ModelConfig
    attention_fn: AttentionFn

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, kv_cache: Any, meta: Any) -> tuple[jax.Array, Any]:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        attn_in = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, name="input_layernorm")(x)
        attn_out, kv_cache = Attention(c, self.attention_fn, name="self_attn")(attn_in, cos, sin, kv_cache, meta)
        x = x + attn_out
        mlp_in = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, name="post_attention_layernorm")(x)
        return x + MLP(c, name="mlp")(mlp_in), kv_cache


class LlamaForCausalLM(nn.Module):
    """Decoder over flattened tokens of many sequences; the attention seam decides how KV is kept.

    `__call__` returns final-normed hidden states; `compute_logits` applies the LM head, so the
    engine computes logits only for the rows it samples from.
    """

    config: ModelConfig
    attention_fn: AttentionFn = dense_attention

    def setup(self) -> None:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        self.embed_tokens = nn.Embed(
            c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, embedding_init=kernel_init
        )
        self.layers = [DecoderLayer(c, self.attention_fn) for _ in range(c.num_layers)]
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if not c.tie_word_embeddings:
            self.lm_head = self.param("lm_head", kernel_init, (c.hidden_size, c.vocab_size), dtype)
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)

    def __call__(
        self, token_ids: jax.Array, positions: jax.Array, kv_caches: Sequence[Any] | None, meta: Any
    ) -> tuple[jax.Array, list[Any]]:
        """token_ids, positions: [T] int32. kv_caches: one entry per layer, or None.

        Returns (hidden [T, H] after the final RMSNorm, new kv_caches as a list, one per layer).
        """
        n = self.config.num_layers
        caches = [None] * n if kv_caches is None else list(kv_caches)
        if len(caches) != n:
            raise ValueError(f"kv_caches: expected {n} entries (one per layer), got {len(caches)}")
        x = self.embed_tokens(token_ids)  # [T, H]
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        new_caches = []
        for layer, cache in zip(self.layers, caches, strict=True):
            x, cache = layer(x, cos, sin, cache, meta)
            new_caches.append(cache)
        return self.norm(x), new_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, H] -> logits [N, V] float32 (accumulated in float32)."""
        if self.config.tie_word_embeddings:
            w = self.embed_tokens.embedding.T  # [H, V]; XLA folds the transpose into the dot
        else:
            w = self.lm_head
        return quant.dot(hidden, w, preferred_element_type=jnp.float32)


__all__ = ["Attention", "DecoderLayer", "LlamaForCausalLM"]
