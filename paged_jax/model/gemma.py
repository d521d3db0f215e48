"""Gemma 2 and Gemma 3 (text): the same decoder, told apart by the config.

Both: RMSNorm scaled by `(1 + weight)` in float32, four norms per layer (before and after attention, before
and after the MLP), GeGLU with tanh-approximate GELU, embeddings times sqrt(hidden_size), scores scaled by
`query_pre_attn_scalar ** -0.5`, sliding-window layers alternating with global ones
(`ModelConfig.sliding_window_pattern`), tied embeddings. Gemma 2 adds the attention-logit soft cap and the
final-logit soft cap; Gemma 3 adds per-head q/k norms and a second RoPE base for its sliding layers
(`rope_local_theta`, unscaled; the global layers' base may carry linear scaling).

Parameter tree: `paged_jax.model.llama`'s, plus `layers_{i}/{pre,post}_feedforward_layernorm/weight` [H] and
(Gemma 3) `layers_{i}/self_attn/{q_norm,k_norm}/weight` [D]. Norm weights are stored as HF stores them (the
offset from 1).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from paged_jax.config import ModelConfig
from paged_jax.lora.delta import LoraLayer
from paged_jax.model.attention import AttentionFn
from paged_jax.model.decoder import Attention, CausalLM, GatedMLP, Rope
from paged_jax.model.layers import RMSNorm


class GemmaRMSNorm(RMSNorm):
    """y = (x * rsqrt(mean(x^2) + eps)) * (1 + weight), all in float32, then cast to x.dtype. x: [..., H]."""

    hidden_size: int
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.zeros, (self.hidden_size,), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


class GemmaDecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then + post_ffw_norm(mlp(pre_ffw_norm(x)))."""

    config: ModelConfig
    attention_fn: AttentionFn
    layer: int
    head_batched_qkv: bool = False  # as in `paged_jax.model.decoder.Attention`

    @nn.compact
    def __call__(
        self, x: jax.Array, rope: Rope, kv_cache: Any, meta: Any, lora: LoraLayer | None = None
    ) -> tuple[jax.Array, Any]:
        c = self.config
        dtype = jnp.dtype(c.dtype)

        def norm(name: str) -> GemmaRMSNorm:
            return GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype, name=name)

        qk_norm = GemmaRMSNorm if c.model_type == "gemma3" else None
        h, kv_cache = Attention(c, self.attention_fn, self.layer, qk_norm, self.head_batched_qkv, name="self_attn")(
            norm("input_layernorm")(x), rope, kv_cache, meta, lora
        )
        x = x + norm("post_attention_layernorm")(h)
        h = GatedMLP(c, "gelu_tanh", name="mlp")(norm("pre_feedforward_layernorm")(x), lora)
        return x + norm("post_feedforward_layernorm")(h), kv_cache


class GemmaForCausalLM(CausalLM):
    """Gemma 2 / Gemma 3 text decoder (`config.model_type` "gemma2" or "gemma3")."""

    scale_embeddings = True
    final_norm = GemmaRMSNorm

    def make_layer(self, layer: int) -> nn.Module:
        return GemmaDecoderLayer(self.config, self.attention_fn, layer)


__all__ = ["GemmaDecoderLayer", "GemmaForCausalLM", "GemmaRMSNorm"]
