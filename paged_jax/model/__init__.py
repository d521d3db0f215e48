"""The decoder families (`families.causal_lm` picks one by `model_type`), the attention seam, and where
parameters come from."""

from paged_jax.model.attention import AttentionFn, DenseMeta, dense_attention
from paged_jax.model.families import FAMILIES, causal_lm
from paged_jax.model.llama import LlamaForCausalLM
from paged_jax.model.weights import (
    WeightsError,
    init_params,
    load_checkpoint,
    load_hf_params,
    load_model,
    param_partition_specs,
    save_checkpoint,
)

__all__ = [
    "FAMILIES",
    "AttentionFn",
    "DenseMeta",
    "LlamaForCausalLM",
    "WeightsError",
    "causal_lm",
    "dense_attention",
    "init_params",
    "load_checkpoint",
    "load_hf_params",
    "load_model",
    "param_partition_specs",
    "save_checkpoint",
]
