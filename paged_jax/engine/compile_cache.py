"""Where does a process keep what it compiled, so that the next one starts without compiling it again?

One directory, `$PAGED_JAX_COMPILE_CACHE` (default `~/.cache/paged-jax/xla`; `off` turns all of it off), used
the same way by every entry point that builds an engine from a model name (the Python API `LLM`, the batch
job, the server, LoRA engines through any of them):

- `executables/`: the executable store (`paged_jax.worker.executable_store`), serialized step executables
  keyed by everything that determines them, loaded without tracing or lowering;
- JAX's persistent compilation cache (the directory itself), for the few jitted functions outside the step
  and for a step executable the store missed whose lowering JAX has seen;
- `weights/`: converted GGUF weights (`paged_jax.model.loader`).

An engine built directly (`LLMEngine(config, params, tokenizer, EngineConfig(...))`) uses the store only when
its `EngineConfig.executable_store` names one.
"""

from __future__ import annotations

import os
from pathlib import Path

from paged_jax.config.engine import EngineConfig
from paged_jax.worker.executables import enable_persistent_cache

ENV = "PAGED_JAX_COMPILE_CACHE"
DEFAULT_DIR = "~/.cache/paged-jax/xla"


def compile_cache_dir() -> Path | None:
    """The directory `$PAGED_JAX_COMPILE_CACHE` names (its default when unset), or None when it is `off`."""
    value = os.environ.get(ENV, os.path.expanduser(DEFAULT_DIR))
    return None if value == "off" else Path(value)


def use_compile_cache(ec: EngineConfig) -> Path | None:
    """Turn on JAX's persistent cache in the directory and point `ec` at its executable store (unless `ec`
    names its own); returns the directory, None when off (nothing is turned on)."""
    cache = compile_cache_dir()
    if cache is None:
        return None
    enable_persistent_cache(str(cache))
    if ec.executable_store is None:
        ec.executable_store = str(cache / "executables")
    return cache
