"""Where a `ModelConfig` comes from: a name under `configs/`, a JSON path, or a Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path

from paged_jax.config.hf import from_hf_config
from paged_jax.config.model import ConfigError, ModelConfig, config_from_dict

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def available_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """Load a config by name (`configs/<name>.json`), from a JSON file, or from an HF model directory."""
    path = Path(name_or_path)
    if path.is_dir():
        hf_path = path / "config.json"
        if not hf_path.exists():
            raise ConfigError(f"model: {path} has no config.json")
        return from_hf_config(json.loads(hf_path.read_text()), name=path.name)
    if path.suffix != ".json":
        path = CONFIG_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise ConfigError(f"model: unknown config {name_or_path!r} (available: {', '.join(available_configs())})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must hold a JSON object")
    data.setdefault("name", path.stem)
    return config_from_dict(data, str(path))
