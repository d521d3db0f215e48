"""Where a `ModelConfig` comes from: a name under `configs/`, a JSON path, or a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

from paged_jax.config.hf import from_hf_config
from paged_jax.config.model import ConfigError, ModelConfig, config_from_dict
from paged_jax.config.model_files import ModelFileError, read_json_object

_PACKAGE = Path(__file__).resolve().parents[1]
# A wheel installs the configs inside the package (paged_jax/configs); a checkout keeps them beside it.
CONFIG_DIR = _PACKAGE / "configs" if (_PACKAGE / "configs").is_dir() else _PACKAGE.parent / "configs"


def available_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """Load a config by name (`configs/<name>.json`), from a JSON file, or from an HF model directory."""
    path = Path(name_or_path)
    if path.is_dir():
        try:
            hf = read_json_object(path, "config.json")
        except ModelFileError as e:
            raise ConfigError(f"model: {path}/{e}") from None
        if not hf:
            raise ConfigError(f"model: {path} has no config.json")
        return from_hf_config(hf, name=path.name)
    if path.suffix != ".json":
        path = CONFIG_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise ConfigError(f"model: unknown config {name_or_path!r} (available: {', '.join(available_configs())})")
    try:
        data = read_json_object(path.parent, path.name)
    except ModelFileError as e:
        raise ConfigError(f"{path}: {e}") from None
    if not data:
        raise ConfigError(f"{path}: no such file, or an empty JSON object")
    data.setdefault("name", path.stem)
    return config_from_dict(data, str(path))
