"""Where parameters come from: one entry point (`load_model`) over the three sources.

- a Hugging Face directory (`config.json` + safetensors): `load_hf_params`;
- an orbax checkpoint written by `save_checkpoint` (config JSON stored beside);
- a config name or JSON path: random weights from a seed (`init_params`).
"""

from __future__ import annotations

from pathlib import Path

from paged_jax.config import ModelConfig, load_model_config
from paged_jax.model.budget import check_fits
from paged_jax.model.checkpoint import is_checkpoint, load_checkpoint, save_checkpoint
from paged_jax.model.hf_import import WeightsError, load_hf_params
from paged_jax.model.init import Params, count_params, init_params, param_bytes, param_shapes
from paged_jax.model.partition import param_partition_specs
from paged_jax.tokenizer import Tokenizer, load_tokenizer


def load_model(model: str | Path, dtype: str | None = None,
               seed: int = 0) -> tuple[ModelConfig, Params, Tokenizer]:
    """(config, params, tokenizer) for an HF directory, an orbax checkpoint, or a config name/JSON.

    `dtype` ("float32" | "bfloat16") overrides the config's parameter/activation dtype. A config whose
    parameters could not fit this machine is refused (ConfigError naming the field) before any allocation.
    """
    path = Path(model)
    if path.is_dir() and is_checkpoint(path):
        config, params = load_checkpoint(path, dtype)
        return config, params, load_tokenizer(path, config)
    config = load_model_config(model)
    if dtype is not None:
        config = config.replace(dtype=dtype)
    check_fits(config)
    if path.is_dir():
        return config, load_hf_params(path, config), load_tokenizer(path, config)
    return config, init_params(config, seed), load_tokenizer(None, config)


__all__ = ["Params", "WeightsError", "count_params", "init_params", "load_checkpoint", "load_hf_params",
           "load_model", "param_bytes", "param_partition_specs", "param_shapes", "save_checkpoint"]
