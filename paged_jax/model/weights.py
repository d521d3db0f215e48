"""Where parameters come from: one entry point (`load_model`) over the sources.

- a Hugging Face directory (`config.json` + safetensors): `load_hf_params`;
- a GGUF file, or the name of a model shipped as one (`named.NAMED_MODELS`): `load_gguf`, its
  tokenizer rebuilt from the file's metadata (`gguf_tokenizer`);
- an orbax checkpoint written by `save_checkpoint` (config JSON stored beside);
- a config name or JSON path: random weights from a seed (`init_params`).
"""

from __future__ import annotations

from pathlib import Path

from paged_jax import quant
from paged_jax.config import ModelConfig, load_model_config
from paged_jax.model.budget import check_fits
from paged_jax.model.checkpoint import is_checkpoint, load_checkpoint, save_checkpoint
from paged_jax.model.gguf_file import GGUFError, is_gguf
from paged_jax.model.hf_import import WeightsError, load_hf_params
from paged_jax.model.init import Params, count_params, init_params, param_bytes, param_shapes
from paged_jax.model.named import named_model_path
from paged_jax.model.partition import param_partition_specs
from paged_jax.tokenizer import Tokenizer, load_tokenizer


def resolve_model_path(model: str | Path) -> Path:
    """A named model's GGUF path, else `model` as a path."""
    return named_model_path(str(model)) or Path(model)


def load_model(
    model: str | Path, dtype: str | None = None, seed: int = 0, quantization: str | None = None
) -> tuple[ModelConfig, Params, Tokenizer]:
    """(config, params, tokenizer) for a GGUF file or named model, an HF directory, an orbax checkpoint,
    or a config name/JSON.

    `dtype` ("float32" | "bfloat16") overrides the config's parameter/activation dtype (GGUF: float32
    unless given, since dequantized values are exact in float32). A config whose parameters could not fit
    this machine is refused (ConfigError naming the field) before any allocation. `quantization` ("int8" |
    "fp8") quantizes the weights after loading (`paged_jax.quant`); a quantized checkpoint loads quantized.
    """
    config, params, tokenizer = _load(model, dtype, seed)
    if quantization is not None and quant.scheme_of(params) is None:
        params = quant.quantize_params(params, quantization)
    return config, params, tokenizer


def _load(model: str | Path, dtype: str | None, seed: int) -> tuple[ModelConfig, Params, Tokenizer]:
    path = resolve_model_path(model)
    if is_gguf(path):
        from paged_jax.gguf_tokenizer import gguf_tokenizer_dir
        from paged_jax.model.gguf_import import load_gguf

        name = str(model) if named_model_path(str(model)) else None
        config, params, gguf = load_gguf(path, dtype=dtype, name=name)
        has_vocab = gguf.get("tokenizer.ggml.model", None) is not None
        return config, params, load_tokenizer(gguf_tokenizer_dir(gguf) if has_vocab else None, config)
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


__all__ = [
    "GGUFError",
    "Params",
    "WeightsError",
    "count_params",
    "init_params",
    "load_checkpoint",
    "load_hf_params",
    "load_model",
    "param_bytes",
    "param_partition_specs",
    "param_shapes",
    "resolve_model_path",
    "save_checkpoint",
]
