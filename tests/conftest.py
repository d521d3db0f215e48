"""Shared fixtures: the embedded tiny config and its random parameters (built once per session), and the
release of each test module's compiled executables."""

from __future__ import annotations

import gc
import lzma
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import pytest

from paged_jax.config import ModelConfig, load_model_config
from paged_jax.model.init import Params, init_params
from paged_jax.worker.runner import EXECUTABLES

MAPS = "/proc/self/maps"
MAX_MAPS = 40_000  # Linux refuses mmap past vm.max_map_count (65,530 by default)


def memory_maps() -> int:
    with open(MAPS) as f:
        return sum(1 for _ in f)


@pytest.fixture(autouse=True, scope="module")
def release_executables():
    """Drop every compiled executable when a test module ends.

    The runners' shared registry (`EXECUTABLES`) and JAX's compile caches keep each executable alive for the
    life of the process, and each XLA:CPU executable
    holds about nine memory maps of its own. One `pytest tests` process compiles many thousands of them: by
    about two thirds of the suite it passed vm.max_map_count, a code mapping failed and the process died
    with SIGSEGV inside XLA. Clearing the caches per module keeps the count flat; the check makes a leak
    (something else holding executables) a test error that names the module instead of a crash."""
    yield
    EXECUTABLES.clear()
    jax.clear_caches()
    gc.collect()
    if os.path.exists(MAPS):
        assert memory_maps() < MAX_MAPS, f"{memory_maps()} memory maps after releasing this module's executables"


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return load_model_config("tiny")


@pytest.fixture(scope="session")
def tiny_params(tiny_config: ModelConfig) -> Params:
    return init_params(tiny_config, seed=0)


TOKENIZER_DATA = Path(__file__).resolve().parent / "data" / "tokenizers"


@pytest.fixture(scope="session")
def real_tokenizer_dir(tmp_path_factory) -> Callable[[str], Path]:
    """A model directory holding a real vocabulary (`phi-3` or `gpt-2`) from tests/data/tokenizers (see its README)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            src, out = TOKENIZER_DATA / name, tmp_path_factory.mktemp(f"tok-{name}")
            for path in src.iterdir():
                if path.name == "tokenizer.json.xz":
                    (out / "tokenizer.json").write_bytes(lzma.decompress(path.read_bytes()))
                elif path.suffix in (".json", ".jinja"):
                    shutil.copy(path, out / path.name)
            made[name] = out
        return made[name]

    return get
