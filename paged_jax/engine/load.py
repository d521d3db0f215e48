"""A model and its tokenizer from one name: `load_model` (the weights from `paged_jax.model.loader`, the
tokenizer from the same source: the directory's files, or a GGUF file's own vocabulary)."""

from __future__ import annotations

from pathlib import Path

from paged_jax.config import ModelConfig
from paged_jax.model.init import Params
from paged_jax.model.loader.weights import LoadedWeights, ModelSource, load_weights
from paged_jax.tokenization.gguf import gguf_tokenizer_dir
from paged_jax.tokenization.tokenizer import Tokenizer, load_tokenizer


def load_model(
    model: str | Path | ModelSource,
    dtype: str | None = None,
    seed: int = 0,
    quantization: str | None = None,
    weights_cache: Path | None = None,
) -> tuple[ModelConfig, Params, Tokenizer]:
    """(config, params, tokenizer) for a GGUF file or named model, an HF directory, an orbax checkpoint,
    or a config name/JSON; the arguments are `paged_jax.model.loader.weights.load_weights`'s."""
    loaded = load_weights(model, dtype, seed, quantization, weights_cache)
    return loaded.config, loaded.params, load_tokenizer(_tokenizer_dir(loaded), loaded.config)


def _tokenizer_dir(loaded: LoadedWeights) -> Path | None:
    """Where the tokenizer's files are: a GGUF file's vocabulary written out, or the model's directory."""
    if loaded.gguf_path is not None:
        return gguf_tokenizer_dir(loaded.gguf_path, loaded.gguf) if loaded.gguf_vocab else None
    return loaded.tokenizer_dir
