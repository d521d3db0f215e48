"""Orbax checkpoints: the parameter tree under `params/`, the model config as JSON beside it.

The tree is the model's own (fused q/k/v and gate/up, `paged_jax.model.loader.fuse`), saved and restored exactly;
a checkpoint written before the fusion (one kernel per projection) is restored in that layout and fused.
Quantized weights (`paged_jax.model.quant`) are stored as `{"qvalues", "qscale"}` pairs, with `quantization.json`
naming the scheme, so a checkpoint written by `paged-jax convert --quantization int8` loads quantized.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax

from paged_jax.config import ModelConfig
from paged_jax.config.model import config_from_dict
from paged_jax.config.model_files import read_json_object
from paged_jax.model import quant
from paged_jax.model.init import Params, param_shapes
from paged_jax.model.loader.budget import check_fits
from paged_jax.model.loader.fuse import fuse_params, import_shapes

CONFIG_FILE = "model_config.json"
QUANT_FILE = "quantization.json"
PARAMS_DIR = "params"


def is_checkpoint(path: str | Path) -> bool:
    """True for a directory written by `save_checkpoint`."""
    path = Path(path)
    return (path / CONFIG_FILE).exists() and (path / PARAMS_DIR).is_dir()


def save_checkpoint(path: str | Path, config: ModelConfig, params: Params) -> None:
    """Write `params` ({"params": ...}) with orbax and `config` as JSON into directory `path` (created)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / PARAMS_DIR, quant.to_storable(params), force=True)
    checkpointer.wait_until_finished()
    (path / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    scheme = quant.scheme_of(params)
    if scheme is not None:
        (path / QUANT_FILE).write_text(json.dumps(scheme) + "\n")


def load_checkpoint(path: str | Path, dtype: str | None = None) -> tuple[ModelConfig, Params]:
    """Restore (config, params) written by `save_checkpoint`; `dtype` overrides the stored dtype."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{path}: not a paged-jax checkpoint (needs {CONFIG_FILE} and {PARAMS_DIR}/)")
    config = config_from_dict(read_json_object(path, CONFIG_FILE), str(path / CONFIG_FILE))
    if dtype is not None:
        config = config.replace(dtype=dtype)
    check_fits(config)
    target = param_shapes(config)
    checkpointer = ocp.StandardCheckpointer()
    scheme = read_json_object(path, QUANT_FILE) or None
    if scheme is not None:  # quantized checkpoints are written in the fused layout
        target = quant.storable_shapes(target, scheme["quantization"], lm_head=scheme["lm_head"])
        restored = checkpointer.restore(path / PARAMS_DIR, target)
    elif _stores_unfused(checkpointer, path / PARAMS_DIR):  # written before q/k/v and gate/up were fused
        restored = fuse_params(config, checkpointer.restore(path / PARAMS_DIR, import_shapes(config)))
    else:
        restored = checkpointer.restore(path / PARAMS_DIR, target)
    params = jax.tree_util.tree_map(lambda x, t: x.astype(t.dtype), restored, target)
    return config, params if scheme is None else quant.from_storable(params, scheme["quantization"] == "w8a8")


def _stores_unfused(checkpointer, params_dir: Path) -> bool:
    """True when the stored tree has one kernel per projection (`q_proj`, ...), not the fused ones."""
    tree = checkpointer.metadata(params_dir)
    tree = getattr(tree, "item_metadata", tree)
    layer = tree["params"].get("layers_0", {}) if hasattr(tree["params"], "get") else {}
    return "q_proj" in layer.get("self_attn", {})


__all__ = ["CONFIG_FILE", "QUANT_FILE", "is_checkpoint", "load_checkpoint", "save_checkpoint"]
