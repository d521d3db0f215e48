"""Shared fixtures: the embedded tiny config and its random parameters (built once per session)."""

from __future__ import annotations

import lzma
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from paged_jax.config import ModelConfig, load_model_config
from paged_jax.model.init import Params, init_params


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
