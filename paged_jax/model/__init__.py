"""The Llama-style model, its attention seam, and where its parameters come from."""

from paged_jax.model.attention import AttentionFn, DenseMeta, dense_attention
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

__all__ = ["AttentionFn", "DenseMeta", "LlamaForCausalLM", "WeightsError", "dense_attention", "init_params",
           "load_checkpoint", "load_hf_params", "load_model", "param_partition_specs", "save_checkpoint"]
