"""Which module builds a config's decoder: `ModelConfig.model_type` -> its causal-LM class.

Every class takes `(config, attention_fn)` and has the contract of `llama.LlamaForCausalLM`:
`apply(params, token_ids [T], positions [T], kv_caches, meta) -> (hidden [T, H], kv_caches)` and
`apply(params, hidden, method="compute_logits") -> logits [N, V] float32`.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from paged_jax.config import ModelConfig
from paged_jax.model.attention import AttentionFn, dense_attention
from paged_jax.model.gemma import GemmaForCausalLM
from paged_jax.model.llama import LlamaForCausalLM
from paged_jax.model.mixtral import MixtralForCausalLM
from paged_jax.model.qwen3 import Qwen3ForCausalLM
from paged_jax.model.qwen3_5 import Qwen35ForCausalLM
from paged_jax.model.qwen3_moe import Qwen3MoeForCausalLM
from paged_jax.model.scan import StackedOrder

FAMILIES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen3_5": Qwen35ForCausalLM,
    "qwen3_5_moe": Qwen35ForCausalLM,
}


def causal_lm(
    config: ModelConfig,
    attention_fn: AttentionFn = dense_attention,
    mesh: jax.sharding.Mesh | None = None,
    scan_layers: bool = False,
    stacked_order: StackedOrder = (),
) -> nn.Module:
    """The decoder of `config`'s family, attending through `attention_fn` (dense by default). `mesh`: the TP mesh
    the step runs on, for the families that place work on it themselves (MoE experts); None on one device.
    `scan_layers`: the layers as one scan over stacked weights in `stacked_order` (`paged_jax.model.scan`)."""
    family = FAMILIES[config.model_type]
    if mesh is not None and config.is_moe:
        return family(
            config, attention_fn=attention_fn, mesh=mesh, scan_layers=scan_layers, stacked_order=stacked_order
        )
    return family(config, attention_fn=attention_fn, scan_layers=scan_layers, stacked_order=stacked_order)


__all__ = ["FAMILIES", "causal_lm"]
