"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm) with a sparse MoE MLP in every layer (`decoder_sparse_step` 1).

Routing renormalises the top-k weights only when `norm_topk_prob` (true for Qwen3-30B-A3B).
Parameter tree: `paged_jax.model.qwen3`'s, with `layers_{i}/mlp` holding the experts of `paged_jax.model.moe`.
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn

from paged_jax.model.decoder import CausalLM, PreNormLayer
from paged_jax.model.layers import RMSNorm
from paged_jax.model.moe import SparseMoE


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-30B-A3B style decoder."""

    def make_layer(self, layer: int) -> nn.Module:
        return PreNormLayer(self.config, self.attention_fn, layer, partial(SparseMoE, mesh=self.mesh), qk_norm=RMSNorm)


__all__ = ["Qwen3MoeForCausalLM"]
