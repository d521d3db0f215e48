"""Will the parameters fit? An estimate from the config alone, checked before anything is allocated.

A config can ask for anything (`num_hidden_layers: 1e9`); building its parameter tree, reading its
shard index or initializing random weights would then run for minutes before memory runs out. The
parameter count is a closed formula of the config (`ModelConfig.num_params`), so the bytes are known
up front and a config that cannot fit this machine is refused naming the field that makes it too big.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import cast

import jax
import jax.numpy as jnp

from paged_jax.config import ConfigError, ModelConfig

# Our field -> the name Hugging Face's config.json gives it (the name a user sees in their file).
SIZE_FIELDS = {
    "num_layers": "num_hidden_layers",
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
}


def param_bytes_estimate(config: ModelConfig) -> int:
    return config.num_params() * jnp.dtype(config.dtype).itemsize


def memory_budget_bytes() -> int:
    """The most parameter bytes this machine could hold: its RAM, or all local accelerators' memory if larger."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    device = 0
    for d in jax.local_devices():
        stats = d.memory_stats() if d.platform != "cpu" else None
        device += (stats or {}).get("bytes_limit", 0)
    return max(host, device)


def _culprit(config: ModelConfig) -> str:
    """The size field whose value contributes most: the one that, set to 1, shrinks the total most."""
    fields = {
        f: getattr(config, f)
        for f in (*SIZE_FIELDS, "attention_bias", "tie_word_embeddings", "model_type", "num_experts")
    }

    def shrunk(name: str) -> int:  # the formula alone: a config with that field at 1 need not be valid
        return ModelConfig.num_params(cast(ModelConfig, SimpleNamespace(**fields | {name: 1})))  # duck-typed

    return min(SIZE_FIELDS, key=shrunk)


def check_fits(config: ModelConfig, budget_bytes: int | None = None) -> None:
    """Raise ConfigError naming the field when the parameters alone exceed `budget_bytes` (default: this
    machine's memory, `memory_budget_bytes`)."""
    need = param_bytes_estimate(config)
    budget = memory_budget_bytes() if budget_bytes is None else budget_bytes
    if need <= budget:
        return
    name = _culprit(config)
    hf = SIZE_FIELDS[name]
    label = name if hf == name else f"{name} ({hf} in config.json)"
    raise ConfigError(
        f"{label}: {getattr(config, name)} makes the parameters {need / 2**30:,.1f} GiB "
        f"({config.num_params():,} x {config.dtype}), more than the {budget / 2**30:,.1f} GiB this "
        "machine has"
    )


__all__ = ["check_fits", "memory_budget_bytes", "param_bytes_estimate"]
