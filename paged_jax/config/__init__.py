"""Typed, validated configuration: the model schema (`model`), where configs come from (`loading`, with the
Hugging Face translation in `hf`), the engine's options (`engine`) and a model's generation defaults
(`generation_defaults`). Importing this package loads neither JAX nor a model."""

from paged_jax.config.loading import CONFIG_DIR, available_configs, load_model_config
from paged_jax.config.model import (
    DTYPES,
    GEMMA_TYPES,
    KV_DTYPE_CHOICES,
    LINEAR_ATTENTION_TYPES,
    MODEL_TYPES,
    MOE_TYPES,
    QK_NORM_TYPES,
    ROPE_TYPES,
    WEIGHT_QUANTIZATIONS,
    ConfigError,
    ModelConfig,
    RopeScaling,
)

__all__ = [
    "CONFIG_DIR",
    "DTYPES",
    "GEMMA_TYPES",
    "KV_DTYPE_CHOICES",
    "MODEL_TYPES",
    "LINEAR_ATTENTION_TYPES",
    "MOE_TYPES",
    "QK_NORM_TYPES",
    "ROPE_TYPES",
    "WEIGHT_QUANTIZATIONS",
    "ConfigError",
    "ModelConfig",
    "RopeScaling",
    "available_configs",
    "load_model_config",
]
