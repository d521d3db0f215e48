"""Where parameters come from: one entry point (`load_weights`) over the sources.

- a Hugging Face directory (`config.json` + safetensors): `load_hf_params`;
- a GGUF file, or the name of a model shipped as one (`named.NAMED_MODELS`): `load_gguf` (its converted
  parameters kept for the next load with a weights cache, `gguf_cache`);
- an orbax checkpoint written by `save_checkpoint` (config JSON stored beside);
- a config name or JSON path: random weights from a seed (`init_params`).

The tokenizer is not loaded here (tokenization sits above the model in the import order): the result says
where it is described, and `paged_jax.engine.load.load_model` builds it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from paged_jax.config import ModelConfig, load_model_config
from paged_jax.model import quant
from paged_jax.model.init import Params, init_params
from paged_jax.model.loader.budget import check_fits
from paged_jax.model.loader.checkpoint import is_checkpoint, load_checkpoint
from paged_jax.model.loader.gguf_cache import load_cached
from paged_jax.model.loader.gguf_file import GGUFFile, is_gguf
from paged_jax.model.loader.hf import load_hf_params
from paged_jax.model.loader.resolve import ModelSource, resolve_model


@dataclass(frozen=True, slots=True)
class LoadedWeights:
    """A model's config and parameters, and where its tokenizer is described."""

    config: ModelConfig
    params: Params
    tokenizer_dir: Path | None  # a directory holding tokenizer files (HF, checkpoint); None: none
    gguf: GGUFFile | None = None  # a GGUF file's metadata, when it was read (not from the weights cache)
    gguf_path: Path | None = None  # the GGUF file the weights came from
    gguf_vocab: bool = False  # that file carries a tokenizer


def resolve_model_path(model: str | Path) -> Path:
    """The file or directory `model` names (a named model's GGUF, a hub cache snapshot, a path); ConfigError
    when it names none (`resolve.resolve_model`)."""
    source = resolve_model(model)
    return source.path if source.path is not None else Path(model)


def load_weights(
    model: str | Path | ModelSource,
    dtype: str | None = None,
    seed: int = 0,
    quantization: str | None = None,
    weights_cache: Path | None = None,
) -> LoadedWeights:
    """Config and parameters for a GGUF file or named model, an HF directory, an orbax checkpoint, or a config
    name/JSON.

    `dtype` ("float32" | "bfloat16") overrides the config's parameter/activation dtype (GGUF: float32
    unless given, since dequantized values are exact in float32). A config whose parameters could not fit
    this machine is refused (ConfigError naming the field) before any allocation. `quantization` ("int8" |
    "fp8") quantizes the weights after loading (`paged_jax.model.quant`); a quantized checkpoint loads quantized.
    `weights_cache`: a directory keeping a GGUF file's converted parameters for the next load
    (`paged_jax.model.loader.gguf_cache`); None: none.
    """
    loaded = _load(model, dtype, seed, weights_cache)
    if quantization is not None and quant.scheme_of(loaded.params) is None:
        params = quant.quantize_params(loaded.params, quantization)
        return dataclasses.replace(loaded, params=params)
    return loaded


def _load(model: str | Path | ModelSource, dtype: str | None, seed: int, weights_cache: Path | None) -> LoadedWeights:
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    path = source.path if source.path is not None else Path(source.spec)
    if is_gguf(path):
        name = source.name if source.kind == "named" else None
        got = load_cached(path, dtype, name, weights_cache)
        return LoadedWeights(got.config, got.params, None, got.gguf, path, got.has_vocab)
    if path.is_dir() and is_checkpoint(path):
        config, params = load_checkpoint(path, dtype)
        return LoadedWeights(config, params, path)
    config = load_model_config(source.load_as)
    if source.kind == "hub":  # its directory is named by a commit hash: the config takes the hub id
        config = config.replace(name=source.name)
    if dtype is not None:
        config = config.replace(dtype=dtype)
    check_fits(config)
    if path.is_dir():
        return LoadedWeights(config, load_hf_params(path, config), path)
    return LoadedWeights(config, init_params(config, seed), None)


__all__ = ["LoadedWeights", "ModelSource", "load_weights", "resolve_model_path"]
