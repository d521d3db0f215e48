"""Qwen3.5 (text, dense and MoE): Gated DeltaNet layers with a gated full-attention layer every
`full_attention_interval` layers (three linear to one full).

Every layer: x + mixer(norm(x)), then + mlp(norm(x)), with Qwen3.5's zero-centred RMSNorm (times 1 + weight, in
float32: `GemmaRMSNorm`'s arithmetic), also for the final norm and the per-head q/k norms.
- Linear layers: `paged_jax.model.gated_deltanet.GatedDeltaNet` (`linear_attn/`).
- Full-attention layers: q/k/v as Qwen3 (fused `qkv_proj`, q/k norms before RoPE), RoPE on the first
  `rotary_dim` dims of each head only (partial rotary), and an output gate: attention out * sigmoid(x @ q_gate)
  per head before o_proj (HF stores q and the gate interleaved per head in one `q_proj`; the loader splits them).
- MLP: SwiGLU (dense), or (MoE) top-k routed experts, renormalised, plus an always-on shared SwiGLU expert scaled
  by sigmoid(x @ shared_expert_gate).

Parameter tree per layer: input_layernorm/weight, post_attention_layernorm/weight [H]; linear_attn/... (see
gated_deltanet) or self_attn/{qkv_proj [H, Hkv, G + 2, D], q_gate [H, Hq, D], o_proj [Hq, D, H],
q_norm/weight, k_norm/weight [D]}; mlp/{gate_up_proj, down_proj} or mlp/{router, experts_gate, experts_up,
experts_down (as `paged_jax.model.moe`), shared_expert/{gate_up_proj [H, 2, Is], down_proj [Is, H]},
shared_expert_gate [H, 1]}.

The layers' trees differ between linear and full layers, so this family runs unrolled (the scanned decoder,
`scan_layers`, refuses it). In the paged engine a full layer's cache entry is its KV pages and a linear layer's is
its `paged_jax.model.linear_state.LinearState` (the recurrent-state pool), both passed and returned by the layer.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from paged_jax.config import ModelConfig
from paged_jax.lora.delta import LoraLayer
from paged_jax.model.attention import AttentionFn
from paged_jax.model.decoder import CausalLM, GatedMLP, Rope
from paged_jax.model.gated_deltanet import GatedDeltaNet
from paged_jax.model.gemma import GemmaRMSNorm
from paged_jax.model.layers import apply_rope, gated_mlp, kernel_init, out_projection, qkv_projection
from paged_jax.model.moe import grouped_experts, route


class GatedAttention(nn.Module):
    """Qwen3.5's full attention (module docstring). x [T, H] -> ([T, H], kv_cache)."""

    config: ModelConfig
    attention_fn: AttentionFn

    @nn.compact
    def __call__(self, x: jax.Array, rope: Rope, kv_cache: Any, meta: Any) -> tuple[jax.Array, Any]:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        h, d, hq, hkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
        attn = {
            "qkv_proj": self.param("qkv_proj", kernel_init, (h, hkv, hq // hkv + 2, d), dtype),
            "o_proj": self.param("o_proj", kernel_init, (hq, d, h), dtype),
        }
        q_gate = self.param("q_gate", kernel_init, (h, hq, d), dtype)
        q, k, v = qkv_projection(x, attn, c)
        q = GemmaRMSNorm(d, c.rms_norm_eps, dtype, name="q_norm")(q)
        k = GemmaRMSNorm(d, c.rms_norm_eps, dtype, name="k_norm")(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, kv_cache = self.attention_fn(q, k, v, kv_cache, meta, sm_scale=c.attn_scale)
        out = out * jax.nn.sigmoid(jnp.einsum("th,hqd->tqd", x, q_gate))
        return out_projection(out, attn), kv_cache


class SharedExpertMoE(nn.Module):
    """Qwen3.5-MoE's MLP: renormalised top-k experts plus the gated shared expert. x [T, H] -> [T, H]."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        e, h, i, s = c.num_experts, c.hidden_size, c.intermediate_size, c.shared_expert_intermediate_size
        router = self.param("router", kernel_init, (h, e), dtype)
        w_gate = self.param("experts_gate", kernel_init, (e, h, i), dtype)
        w_up = self.param("experts_up", kernel_init, (e, h, i), dtype)
        w_down = self.param("experts_down", kernel_init, (e, i, h), dtype)
        gate = self.param("shared_expert_gate", kernel_init, (h, 1), dtype)
        weights, experts = route(x @ router, c.num_experts_per_tok, True)
        routed = grouped_experts(x, weights, experts, w_gate, w_up, w_down).astype(dtype)
        shared = SharedExpert(h, s, dtype, name="shared_expert")(x)
        return routed + jax.nn.sigmoid(x @ gate) * shared


class SharedExpert(nn.Module):
    """A SwiGLU MLP of its own width: gate_up_proj [H, 2, I], down_proj [I, H]."""

    hidden_size: int
    intermediate_size: int
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h, i = self.hidden_size, self.intermediate_size
        mlp = {
            "gate_up_proj": self.param("gate_up_proj", kernel_init, (h, 2, i), self.dtype),
            "down_proj": self.param("down_proj", kernel_init, (i, h), self.dtype),
        }
        return gated_mlp(x, mlp)


class Qwen35Layer(nn.Module):
    """One Qwen3.5 layer: Gated DeltaNet or gated full attention by `config.is_linear_layer(layer)`, then the MLP."""

    config: ModelConfig
    attention_fn: AttentionFn
    layer: int

    @nn.compact
    def __call__(
        self, x: jax.Array, rope: Rope, kv_cache: Any, meta: Any, lora: LoraLayer | None = None
    ) -> tuple[jax.Array, Any]:
        if lora is not None:
            raise ValueError("lora: LoRA adapters are not supported for Qwen3.5")
        c = self.config
        dtype = jnp.dtype(c.dtype)
        h = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype, name="input_layernorm")(x)
        if c.is_linear_layer(self.layer):
            h, kv_cache = GatedDeltaNet(c, name="linear_attn")(h, meta, kv_cache)
        else:
            h, kv_cache = GatedAttention(c, self.attention_fn, name="self_attn")(h, rope, kv_cache, meta)
        x = x + h
        h = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype, name="post_attention_layernorm")(x)
        mlp = SharedExpertMoE(c, name="mlp") if c.is_moe else GatedMLP(c, name="mlp")
        return x + mlp(h), kv_cache


class Qwen35ForCausalLM(CausalLM):
    """Qwen3.5 / Qwen3.5-MoE text decoder (`config.model_type` "qwen3_5" or "qwen3_5_moe"), unrolled."""

    final_norm = GemmaRMSNorm

    def setup(self) -> None:
        if self.scan_layers:
            raise ValueError(
                "scan_layers: Qwen3.5's linear and full-attention layers hold different weights, so it runs unrolled"
            )
        super().setup()

    def make_layer(self, layer: int) -> nn.Module:
        return Qwen35Layer(self.config, self.attention_fn, layer)


__all__ = ["GatedAttention", "Qwen35ForCausalLM", "Qwen35Layer", "SharedExpertMoE"]
