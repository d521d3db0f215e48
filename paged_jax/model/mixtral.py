"""Mixtral: Mistral's attention (GQA, optional sliding window) with a top-2 sparse MoE MLP in every layer.

Parameter tree: `paged_jax.model.llama`'s, with `layers_{i}/mlp` holding the experts of `paged_jax.model.moe`.
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn

from paged_jax.model.decoder import CausalLM, PreNormLayer
from paged_jax.model.moe import SparseMoE


class MixtralForCausalLM(CausalLM):
    """Mixtral-8x7B style decoder: pre-norm layers, softmax top-k routing with renormalised weights."""

    def make_layer(self, layer: int) -> nn.Module:
        return PreNormLayer(self.config, self.attention_fn, layer, partial(SparseMoE, mesh=self.mesh))


__all__ = ["MixtralForCausalLM"]
