"""Shared fixtures: the embedded tiny config and its random parameters (built once per session)."""

from __future__ import annotations

import pytest

from paged_jax.config import ModelConfig, load_model_config
from paged_jax.model.init import Params, init_params


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return load_model_config("tiny")


@pytest.fixture(scope="session")
def tiny_params(tiny_config: ModelConfig) -> Params:
    return init_params(tiny_config, seed=0)
