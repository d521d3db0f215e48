"""Fused projections: q/k/v as one matmul and gate/up as one, laid out so tensor parallelism stays whole.

Importers (Hugging Face, GGUF) produce the *import layout*, one kernel per projection as checkpoints store
them; `fuse_params` turns it into the model's tree once, at load time (plain concatenations: exact):

    self_attn/q_proj [H, Hq, D], k_proj [H, Hkv, D], v_proj [H, Hkv, D]
        -> self_attn/qkv_proj [H, Hkv, G + 2, D]     (G = Hq / Hkv query heads per KV head)
    self_attn/q_bias [Hq, D], k_bias, v_bias [Hkv, D]
        -> self_attn/qkv_bias [Hkv, G + 2, D]
    mlp/gate_proj [H, I], up_proj [H, I]
        -> mlp/gate_up_proj [H, 2, I]

Why grouped per KV head: entry `[:, j, :G]` holds query heads `j * G .. j * G + G - 1` (the ones that read KV
head j, as HF's `repeat_kv` pairs them), `[:, j, G]` KV head j's K and `[:, j, G + 1]` its V. Tensor
parallelism splits axis 1, so every shard holds whole (queries, key, value) groups of its own KV heads. A
plain `[q | k | v]` concatenation split column-wise would hand one shard all of K and another all of V.
gate/up keep their own axis, so splitting I gives each shard matching gate and up columns.

On XLA:CPU a decode step's projections are small matmuls ([32, 576] x [576, 576] for SmolLM2-135M) whose
cost is as much the call as the FLOPs; one call reads x once and makes one larger GEMM.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from paged_jax.config import ModelConfig
from paged_jax.model.init import param_shapes
from paged_jax.model.layers import fuse_qkv, split_qkv
from paged_jax.model.quant import QuantizedWeight

Params = dict[str, Any]


def _layer_names(params: Params) -> list[str]:
    return sorted(k for k in params["params"] if k.startswith("layers_"))


def fuse_params(config: ModelConfig, params: Params) -> Params:
    """The model's tree from the import layout (module docstring); other leaves are shared, not copied.

    Each layer's separate kernels are dropped as soon as its fused ones exist, so the peak is one layer's
    extra copy. Works on concrete arrays and under `jax.eval_shape`.
    """
    group = config.num_heads // config.num_kv_heads
    out = {"params": dict(params["params"])}
    for name in _layer_names(params):
        layer = dict(out["params"][name])
        if "self_attn" in layer:  # (a linear-attention layer has none)
            attn = dict(layer["self_attn"])
            if "q_proj_gated" in attn:  # Qwen3.5: q and its output gate interleaved per head [H, Hq, 2, D]
                gated = attn.pop("q_proj_gated")
                attn["q_proj"], attn["q_gate"] = gated[:, :, 0], gated[:, :, 1]
            attn["qkv_proj"] = fuse_qkv(attn.pop("q_proj"), attn.pop("k_proj"), attn.pop("v_proj"), group)
            if "q_bias" in attn:
                attn["qkv_bias"] = fuse_qkv(attn.pop("q_bias"), attn.pop("k_bias"), attn.pop("v_bias"), group)
            layer["self_attn"] = attn
        layer["mlp"] = _fuse_gate_up(dict(layer["mlp"]))
        out["params"][name] = layer
    return out


def _fuse_gate_up(mlp: dict) -> dict:
    """gate_proj/up_proj -> gate_up_proj in a dense MLP and in a shared expert (an MoE block's routed experts are
    already one array each)."""
    if "gate_proj" in mlp:
        mlp["gate_up_proj"] = jnp.stack([mlp.pop("gate_proj"), mlp.pop("up_proj")], axis=1)
    if "shared_expert" in mlp:
        mlp["shared_expert"] = _fuse_gate_up(dict(mlp["shared_expert"]))
    return mlp


def _unfuse_gate_up(mlp: dict) -> dict:
    if "gate_up_proj" in mlp:
        gate_up = mlp.pop("gate_up_proj")
        mlp["gate_proj"], mlp["up_proj"] = gate_up[:, 0], gate_up[:, 1]
    if "shared_expert" in mlp:
        mlp["shared_expert"] = _unfuse_gate_up(dict(mlp["shared_expert"]))
    return mlp


def unfuse_params(params: Params) -> Params:
    """The import layout from the model's tree (the inverse of `fuse_params`, exact)."""
    out = {"params": dict(params["params"])}
    for name in _layer_names(params):
        layer = dict(out["params"][name])
        if "self_attn" in layer:
            attn = dict(layer["self_attn"])
            attn["q_proj"], attn["k_proj"], attn["v_proj"] = split_qkv(attn.pop("qkv_proj"))
            if "qkv_bias" in attn:
                attn["q_bias"], attn["k_bias"], attn["v_bias"] = split_qkv(attn.pop("qkv_bias"))
            if "q_gate" in attn:
                attn["q_proj_gated"] = jnp.stack([attn.pop("q_proj"), attn.pop("q_gate")], axis=2)
            layer["self_attn"] = attn
        layer["mlp"] = _unfuse_gate_up(dict(layer["mlp"]))
        out["params"][name] = layer
    return out


def import_shapes(config: ModelConfig) -> Params:
    """The import layout's tree as `jax.ShapeDtypeStruct` leaves (what checkpoints are checked against)."""
    return jax.eval_shape(unfuse_params, param_shapes(config))


def expand_fused_kv_heads(params: Params, r: int) -> Params:
    """Repeat every KV head `r` times in the fused tree (tensor parallelism wider than the KV heads).

    qkv_proj [H, Hkv, G + 2, D] -> [H, Hkv * r, G / r + 2, D]: new KV head `j * r + i` holds old head j's
    K and V and its query heads `i * G / r .. (i + 1) * G / r - 1`, so query head h still reads old KV head
    h // G (`paged_jax.worker.sharding` explains why that is the same function). Biases likewise.
    """

    def expand(w: jax.Array) -> jax.Array:
        q, k, v = split_qkv(w)  # q [..., Hq, D], k/v [..., Hkv, D]
        hkv = k.shape[-2]
        k, v = jnp.repeat(k, r, axis=-2), jnp.repeat(v, r, axis=-2)
        return fuse_qkv(q, k, v, q.shape[-2] // (hkv * r))

    def leaf(path: tuple[Any, ...], x: Any) -> Any:
        name = str(getattr(path[-1], "key", path[-1]))
        if name == "qkv_proj" and isinstance(x, QuantizedWeight):  # scales [Hkv, G + 2, D] expand alike
            return dataclasses.replace(x, values=expand(x.values), scale=expand(x.scale))
        return expand(x) if name in ("qkv_proj", "qkv_bias") else x

    return jax.tree_util.tree_map_with_path(leaf, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))


__all__ = ["expand_fused_kv_heads", "fuse_params", "import_shapes", "unfuse_params"]
