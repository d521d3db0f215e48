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
tensor parallelism keeps whole groups): `paged_jax.model.loader.fuse` explains the layout and converts from the
one-kernel-per-projection layout that importers produce.

The blocks are `paged_jax.model.decoder`'s (every family shares them): Llama is the plain pre-norm layer with a
SwiGLU MLP, no q/k norm, RoPE with Llama-3 scaling when the config has it.
"""

from __future__ import annotations

import flax.linen as nn

from paged_jax.model.decoder import CausalLM, GatedMLP, PreNormLayer


class LlamaForCausalLM(CausalLM):
    """Decoder over flattened tokens of many sequences; the attention seam decides how KV is kept.

    `__call__` returns final-normed hidden states; `compute_logits` applies the LM head, so the
    engine computes logits only for the rows it samples from.
    """

    def make_layer(self, layer: int) -> nn.Module:
        return PreNormLayer(self.config, self.attention_fn, layer, GatedMLP)


__all__ = ["LlamaForCausalLM"]
