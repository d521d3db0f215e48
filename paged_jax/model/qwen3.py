"""Qwen3 (dense): Llama's block with a per-head RMSNorm on q and k before RoPE, no q/k/v biases, and a
head_dim set independently of the hidden size.

Parameter tree: `paged_jax.model.llama`'s, plus `layers_{i}/self_attn/{q_norm,k_norm}/weight` [D].
"""

from __future__ import annotations

import flax.linen as nn

from paged_jax.model.decoder import CausalLM, GatedMLP, PreNormLayer
from paged_jax.model.layers import RMSNorm


class Qwen3ForCausalLM(CausalLM):
    """Qwen3: pre-norm layers, q/k RMSNorm (Llama-style: cast to the model dtype, then times the weight), SwiGLU."""

    def make_layer(self, layer: int) -> nn.Module:
        return PreNormLayer(self.config, self.attention_fn, layer, GatedMLP, qk_norm=RMSNorm)


__all__ = ["Qwen3ForCausalLM"]
