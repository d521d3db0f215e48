"""Import a Hugging Face Llama-family directory (`config.json` + safetensors) without torch or pickle.

Reads `model.safetensors` or the shards listed in `model.safetensors.index.json` (or, failing both,
every `*.safetensors` file), maps HF names onto our tree and transposes HF's [out, in] weights into
our [in, ...out] kernels. Every problem raises `WeightsError` naming the tensor, and is found from the
files' headers before any tensor is read (an unexpected 512 MiB tensor costs nothing); tensors are
then read one at a time. Shard paths must stay inside the model directory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from paged_jax.config import ModelConfig
from paged_jax.model.init import Params, param_shapes

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # safetensors header dtype -> ours


class WeightsError(ValueError):
    """Checkpoint tensors do not fit the model; the message names the tensor."""


def safetensors_files(model_dir: Path) -> list[Path]:
    """The safetensors files of an HF directory, via the shard index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightsError(f"{index}: no 'weight_map' object")
        root = model_dir.resolve()
        for name, f in weight_map.items():
            if not isinstance(f, str) or not (model_dir / f).resolve().is_relative_to(root):
                raise WeightsError(f"{name}: its shard {f!r} in {index.name} is not a file inside {model_dir}")
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


def _headers(files: list[Path]) -> dict[Path, list[tuple[str, tuple[int, ...], str]]]:
    """(name, shape, dtype) of every tensor, per file, from the headers alone (no tensor data is read)."""
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), framework="flax") as handle:
            out[f] = [(name, tuple(handle.get_slice(name).get_shape()), handle.get_slice(name).get_dtype())
                      for name in handle.keys()]
    return out


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
    rules = hf_name_map(config)
    shapes = param_shapes(config)["params"]
    dtype = jnp.dtype(config.dtype)
    wanted: dict[Path, list[str]] = {}  # file -> the tensors to read from it
    seen: set[str] = set()
    for f, tensors in _headers(safetensors_files(model_dir)).items():
        for name, shape, stored in tensors:
            if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
                continue  # tied checkpoints sometimes store the head too; the embedding is used
            if name not in rules:
                raise WeightsError(f"{name}: unexpected tensor in {model_dir} (not part of this model's config)")
            if name in seen:
                raise WeightsError(f"{name}: stored twice in {model_dir}")
            seen.add(name)
            if stored not in FLOAT_DTYPES:
                raise WeightsError(f"{name}: dtype {_dtype_name(stored)} cannot be loaded "
                                   "(need float32/bfloat16/float16)")
            hf_shape = _hf_shape(name, tuple(_get(shapes, rules[name][0]).shape))
            if shape != hf_shape:
                raise WeightsError(f"{name}: shape {shape} does not fit the config (expected {hf_shape})")
            wanted.setdefault(f, []).append(name)
    missing = sorted(set(rules) - seen)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightsError(f"{missing[0]}: missing from {model_dir}{more}")
    return {"params": _read(wanted, rules, dtype)}


def _dtype_name(stored: str) -> str:
    """A safetensors header dtype ("I32") as numpy spells it ("int32")."""
    kinds = {"F": "float", "I": "int", "U": "uint", "BF": "bfloat"}
    kind = stored.rstrip("0123456789")
    return f"{kinds[kind]}{stored[len(kind):]}" if kind in kinds else stored.lower()


def _read(wanted: dict[Path, list[str]], rules: dict[str, tuple[tuple[str, ...], Callable]],
          dtype: jnp.dtype) -> dict:
    """Read the checked tensors one at a time into our tree (each freed on the host before the next)."""
    from safetensors import safe_open

    params: dict = {}
    for f, names in wanted.items():
        with safe_open(str(f), framework="flax") as handle:
            for name in names:
                path, transform = rules[name]
                _set(params, path, jnp.asarray(transform(handle.get_tensor(name)), dtype=dtype))
    return params


__all__ = ["WeightsError", "hf_name_map", "load_hf_params", "safetensors_files"]
