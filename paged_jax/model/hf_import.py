"""Import a Hugging Face Llama-family directory (`config.json` + safetensors) without torch or pickle.

Reads `model.safetensors` or the shards listed in `model.safetensors.index.json` (or, failing both,
every `*.safetensors` file), one tensor at a time, maps HF names onto our tree and transposes HF's
[out, in] weights into our [in, ...out] kernels. Every problem raises `WeightsError` naming the tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from paged_jax.config import ModelConfig
from paged_jax.model.init import Params, param_shapes

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class WeightsError(ValueError):
    """Checkpoint tensors do not fit the model; the message names the tensor."""


def safetensors_files(model_dir: Path) -> list[Path]:
    """The safetensors files of an HF directory, via the shard index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightsError(f"{index}: no 'weight_map' object")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
    elif (model_dir / "model.safetensors").exists():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{model_dir}: no *.safetensors files (pickled .bin checkpoints are not read)")
    for f in files:
        if not f.exists():
            raise WeightsError(f"{f}: listed in the shard index but missing")
    return files


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, jax.Array]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="flax") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def _layer_rules(config: ModelConfig, i: int) -> dict[str, tuple[tuple[str, ...], Callable]]:
    """HF tensor name -> (our path, transform from the HF array) for layer i."""
    h, d, hq, hkv = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
    pre, ours = f"model.layers.{i}.", f"layers_{i}"
    rules: dict[str, tuple[tuple[str, ...], Callable]] = {
        "input_layernorm.weight": ((ours, "input_layernorm", "weight"), lambda w: w),
        "post_attention_layernorm.weight": ((ours, "post_attention_layernorm", "weight"), lambda w: w),
        "self_attn.q_proj.weight": ((ours, "self_attn", "q_proj"), lambda w: w.T.reshape(h, hq, d)),
        "self_attn.k_proj.weight": ((ours, "self_attn", "k_proj"), lambda w: w.T.reshape(h, hkv, d)),
        "self_attn.v_proj.weight": ((ours, "self_attn", "v_proj"), lambda w: w.T.reshape(h, hkv, d)),
        "self_attn.o_proj.weight": ((ours, "self_attn", "o_proj"), lambda w: w.T.reshape(hq, d, h)),
        "mlp.gate_proj.weight": ((ours, "mlp", "gate_proj"), lambda w: w.T),
        "mlp.up_proj.weight": ((ours, "mlp", "up_proj"), lambda w: w.T),
        "mlp.down_proj.weight": ((ours, "mlp", "down_proj"), lambda w: w.T),
    }
    if config.attention_bias:
        for proj, heads in (("q", hq), ("k", hkv), ("v", hkv)):
            rules[f"self_attn.{proj}_proj.bias"] = ((ours, "self_attn", f"{proj}_bias"),
                                                   lambda w, n=heads: w.reshape(n, d))
    return {pre + k: v for k, v in rules.items()}


def hf_name_map(config: ModelConfig) -> dict[str, tuple[tuple[str, ...], Callable]]:
    """Every HF tensor name the model needs -> (our parameter path, transform)."""
    rules: dict[str, tuple[tuple[str, ...], Callable]] = {
        "model.embed_tokens.weight": (("embed_tokens", "embedding"), lambda w: w),
        "model.norm.weight": (("norm", "weight"), lambda w: w),
    }
    if not config.tie_word_embeddings:
        rules["lm_head.weight"] = (("lm_head",), lambda w: w.T)
    for i in range(config.num_layers):
        rules.update(_layer_rules(config, i))
    return rules


def _get(tree: dict, path: tuple[str, ...]) -> jax.ShapeDtypeStruct:
    for key in path:
        tree = tree[key]
    return tree  # type: ignore[return-value]


def _set(tree: dict, path: tuple[str, ...], value: jax.Array) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _hf_shape(name: str, ours: tuple[int, ...]) -> tuple[int, ...]:
    """The HF [out, in] shape of a tensor whose kernel we store as `ours` ([in, ...out] or [Hq, D, H])."""
    if name.endswith("o_proj.weight"):
        return (ours[2], ours[0] * ours[1])
    if name.endswith("_proj.bias"):
        return (ours[0] * ours[1],)
    if len(ours) == 3:
        return (ours[1] * ours[2], ours[0])
    if len(ours) == 2 and name != "model.embed_tokens.weight":
        return (ours[1], ours[0])
    return ours


def load_hf_params(model_dir: str | Path, config: ModelConfig) -> Params:
    """Parameters from an HF directory's safetensors, cast to `config.dtype`. Raises `WeightsError`."""
    model_dir = Path(model_dir)
    return params_from_hf_tensors(_iter_tensors(safetensors_files(model_dir)), config, str(model_dir))


def params_from_hf_tensors(tensors: Iterable[tuple[str, Any]], config: ModelConfig, source: str) -> Params:
    """Our parameter tree from (HF tensor name, [out, in] array) pairs, consumed one at a time.

    Every tensor the config needs must appear exactly once; each is shape-checked, transformed
    into our layout and cast to `config.dtype`. `source` names the checkpoint in errors.
    """
    rules = hf_name_map(config)
    shapes = param_shapes(config)["params"]
    dtype = jnp.dtype(config.dtype)
    params: dict = {}
    seen: set[str] = set()
    for name, tensor in tensors:
        if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue  # tied checkpoints sometimes store the head too; the embedding is used
        if name not in rules:
            raise WeightsError(f"{name}: unexpected tensor in {source} (not part of this model's config)")
        if name in seen:
            raise WeightsError(f"{name}: stored twice in {source}")
        seen.add(name)
        if not any(tensor.dtype == jnp.dtype(d) for d in FLOAT_DTYPES):
            raise WeightsError(f"{name}: dtype {tensor.dtype} cannot be loaded (need float32/bfloat16/float16)")
        path, transform = rules[name]
        want = tuple(_get(shapes, path).shape)
        hf_shape = _hf_shape(name, want)
        if tuple(tensor.shape) != hf_shape:
            raise WeightsError(f"{name}: shape {tuple(tensor.shape)} does not fit the config (expected {hf_shape})")
        value = transform(tensor)
        _set(params, path, jnp.asarray(value, dtype=dtype))
    missing = sorted(set(rules) - seen)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightsError(f"{missing[0]}: missing from {source}{more}")
    return {"params": params}


__all__ = ["WeightsError", "hf_name_map", "load_hf_params", "params_from_hf_tensors", "safetensors_files"]
