"""Where do the weights and KV pages live? Tensor parallelism on a `jax.sharding.Mesh` with one "tp" axis.

Layout (specs from `paged_jax.model.partition`): q/k/v projections by heads, o_proj by its input heads,
the MLP by its intermediate dimension, embedding and LM head by vocabulary, norms replicated. The KV page
arrays `[num_pages, Hkv, page_size, 2 * D]` are split along axis 1, so each chip holds the pages of its own
KV heads (a head's K and V share its rows).
The paged-attention call (write new K/V, then the ragged kernel) runs per shard under `shard_map`: q, k, v
by heads, the pages by KV heads, the step metadata replicated. Everything else is plain `jit` over sharded
operands: XLA inserts the all-reduce after o_proj and down_proj and the all-gather of the vocab-sharded
logits (the step returns them replicated, so the sampler runs unchanged on every chip of the group).

KV-head replication: when TP exceeds the KV head count (Llama-3-70B on 16 chips, or 2 KV heads on 4 chips),
`expand_kv_heads` repeats every KV head `r = tp // Hkv` times, in the fused q/k/v projection weights and
biases (new KV head j is old head j // r, and it takes the G / r of old head j's query heads that read it),
and the model runs as if it had `Hkv * r` KV heads. Query head h reads
KV head h // (Hq / (Hkv * r)), which is old head h // (Hq / Hkv): the same function, exactly. Each chip then
projects and stores its own copy of one KV head, so no KV ever crosses chips; the price is r copies of KV
memory over the group (per chip it is the same as with one real head per chip).

The host side does not change: one scheduler and one KV manager per engine; block tables, slot mappings
and every other metadata array are identical on all shards. Data parallelism (`paged_jax.engine.data_parallel`) puts
independent engines on disjoint device groups from `dp_device_groups`; multi-host runs one such group set
per host (see `paged_jax.offline.multihost` for that decision).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from paged_jax.config import ModelConfig
from paged_jax.model.attention import LayerPages
from paged_jax.model.init import param_shapes
from paged_jax.model.loader.fuse import expand_fused_kv_heads
from paged_jax.model.partition import param_partition_specs
from paged_jax.model.quant import abstract_params
from paged_jax.model.scan import LAYERS, StackedOrder, to_stacked_order
from pallas_kernels.kv_quant import QuantizedPages

TP = "tp"
KV_SPEC = P(None, TP, None, None)  # [num_pages, Hkv, page_size, 2 * D]: split by KV heads
KV_SCALES_SPEC = P(None, TP)  # quantized pages' scales [num_pages, Hkv * 2 * page_size]: heads are axis 1's major
HEADS_SPEC = P(None, TP, None)  # q [T, Hq, D], k/v [T, Hkv, D]: split by heads


def kv_replication(config: ModelConfig, tp: int) -> int:
    """How many copies of each KV head a TP degree of `tp` needs (1 when tp <= num_kv_heads).

    Raises ValueError when `tp` cannot split the model: it must divide num_heads, intermediate_size and
    vocab_size, and either divide num_kv_heads or be a multiple of it.
    """
    if tp < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {tp}")
    for name in ("num_heads", "intermediate_size", "vocab_size"):
        if getattr(config, name) % tp:
            raise ValueError(f"tensor_parallel_size: {tp} does not divide {name} ({getattr(config, name)})")
    hkv = config.num_kv_heads
    if hkv % tp == 0:
        return 1
    if tp % hkv:
        raise ValueError(f"tensor_parallel_size: {tp} neither divides nor is a multiple of num_kv_heads ({hkv})")
    return tp // hkv


def expand_kv_heads(config: ModelConfig, params: Any, r: int) -> tuple[ModelConfig, Any]:
    """Repeat every KV head `r` times: the fused qkv_proj [H, Hkv, G + 2, D] -> [H, Hkv * r, G / r + 2, D]
    (`paged_jax.model.loader.fuse.expand_fused_kv_heads`; biases likewise).

    Returns the config with `num_kv_heads * r` and the new parameter tree (other leaves are shared, not
    copied). Works on concrete arrays and inside `jit`. The model's outputs are unchanged (module docstring).
    """
    if r == 1:
        return config, params
    return config.replace(num_kv_heads=config.num_kv_heads * r), expand_fused_kv_heads(params, r)


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A 1-D mesh with axis "tp" over `devices` (one tensor-parallel group)."""
    return Mesh(np.asarray(list(devices), dtype=object), (TP,))


def dp_device_groups(dp: int, tp: int, devices: Sequence[jax.Device] | None = None) -> list[list[jax.Device]]:
    """`dp` disjoint groups of `tp` devices each, from `devices` (default: this process's local devices).

    Consecutive devices form a group, which on TPU keeps a TP group on neighbouring chips (ICI links).
    """
    devices = list(jax.local_devices() if devices is None else devices)
    if dp < 1 or tp < 1:
        raise ValueError(f"data_parallel_size and tensor_parallel_size must be >= 1, got {dp} and {tp}")
    if dp * tp > len(devices):
        raise ValueError(
            f"data_parallel_size x tensor_parallel_size = {dp} x {tp} = {dp * tp} devices, "
            f"but only {len(devices)} are available"
        )
    return [devices[i * tp : (i + 1) * tp] for i in range(dp)]


def param_shardings(config: ModelConfig, mesh: Mesh, params: Any | None = None, order: StackedOrder = ()) -> Any:
    """A `NamedSharding` per parameter leaf (tree of `params`, default the config's abstract tree); `order`: the
    stacked leaves' axis order (`paged_jax.model.scan.stacked_order`)."""
    specs = param_partition_specs(config, param_shapes(config) if params is None else params, TP, order)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def kv_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_SPEC)


def kv_scales_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_SCALES_SPEC)


def kv_cache_spec(quantized: bool):
    """The partition spec (pytree) of one layer's cache: the pages, or quantized pages and their scales."""
    return QuantizedPages(KV_SPEC, KV_SCALES_SPEC) if quantized else KV_SPEC  # type: ignore[arg-type]  # partition specs stand in for arrays


def kv_cache_sharding(mesh: Mesh, quantized: bool):
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), kv_cache_spec(quantized), is_leaf=lambda x: isinstance(x, P)
    )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_params(config: ModelConfig, params: Any, mesh: Mesh) -> tuple[ModelConfig, Any]:
    """Replicate KV heads as needed (`expand_kv_heads`) and place every leaf on `mesh` by its spec.

    Returns (the config the runner must use, the placed params). The repeat runs under `jit` with sharded
    outputs, so each chip only ever receives its own slices.
    """
    r = kv_replication(config, mesh.size)
    run_config = config.replace(num_kv_heads=config.num_kv_heads * r) if r > 1 else config
    shardings = param_shardings(run_config, mesh, params)  # the tree of `params` (quantized weights too)
    if r == 1:
        return run_config, jax.device_put(params, shardings)
    expand = jax.jit(lambda p: expand_kv_heads(config, p, r)[1], out_shardings=shardings)
    return run_config, expand(params)


def shard_attention(
    attention_fn: Callable[..., tuple[jax.Array, jax.Array]], mesh: Mesh, quantized: bool = False
) -> Callable:
    """Run the paged `attention_fn(q, k, v, kv_pages, meta, *, sm_scale)` per TP shard with `shard_map`.

    Per shard: q [T, Hq / tp, D], k/v [T, Hkv / tp, D], kv_pages [P, Hkv / tp, page, 2 * D] (or a scanned
    layer's `LayerPages` view of the stacked pages, split alike), meta whole.
    GQA groups stay on one chip because tp divides Hkv (after `expand_kv_heads`).
    """
    if mesh.size == 1:
        return attention_fn

    def sharded(q, k, v, kv_pages, meta, *, sm_scale: float, **layer_options):
        body = functools.partial(attention_fn, sm_scale=sm_scale, **layer_options)  # per-layer window and cap
        kv = kv_cache_spec(quantized)
        if isinstance(kv_pages, LayerPages):  # a scanned layer's view: the stacked pages as above, its index whole
            kv = dataclasses.replace(kv_pages, pages=kv, layer=P())  # type: ignore[arg-type]  # partition specs stand in for arrays
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(HEADS_SPEC, HEADS_SPEC, HEADS_SPEC, kv, P()),
            out_specs=(HEADS_SPEC, kv),
            check_vma=False,
        )(q, k, v, kv_pages, meta)

    return sharded


def step_shardings(
    config: ModelConfig,
    mesh: Mesh,
    quantized: bool = False,
    weights: tuple[str, bool, bool] | None = None,
    scan: bool = False,
    order: StackedOrder = (),
) -> dict[str, Any]:
    """`jit` keyword arguments pinning the forward step's operands to `mesh`.

    forward(params, kv_caches, token_ids, positions, meta, logits_indices): params by their specs, the
    per-layer pages by KV heads, metadata replicated; out: logits replicated, pages as they came in, the
    hidden states replicated. `quantized`: KV pages with scales; `weights`: `paged_jax.model.quant.weights_key`
    of quantized params; `scan`: the scanned decoder (stacked params in `order`, one stacked cache).
    """
    kv = kv_cache_sharding(mesh, quantized)
    kv = kv if scan else (kv,) * config.num_layers
    rep = replicated(mesh)
    params = _abstract_params(config, weights, scan, order)
    return {
        "in_shardings": (param_shardings(config, mesh, params, order), kv, rep, rep, rep, rep),
        "out_shardings": (rep, kv, rep),
    }


def logits_shardings(
    config: ModelConfig,
    mesh: Mesh,
    weights: tuple[str, bool, bool] | None = None,
    scan: bool = False,
    order: StackedOrder = (),
) -> dict[str, Any]:
    """`jit` keyword arguments of a function (params, *replicated arrays) -> replicated outputs that applies the
    LM head (`paged_jax.worker.prompt_logprobs`): params by their specs, everything else replicated."""
    rep = replicated(mesh)
    params = param_shardings(config, mesh, _abstract_params(config, weights, scan, order), order)
    return {"in_shardings": (params, rep, rep, rep, rep), "out_shardings": rep}


def _abstract_params(config: ModelConfig, weights: tuple[str, bool, bool] | None, scan: bool, order: StackedOrder):
    """The abstract parameter tree a step takes: per layer, or stacked with its leaves in `order`."""
    params = abstract_params(param_shapes(config, scan), weights)
    if not (scan and order):
        return params
    layers = jax.eval_shape(functools.partial(to_stacked_order, order=order), params["params"][LAYERS])
    return {"params": {**params["params"], LAYERS: layers}}


__all__ = [
    "KV_SCALES_SPEC",
    "KV_SPEC",
    "TP",
    "dp_device_groups",
    "expand_kv_heads",
    "kv_cache_sharding",
    "kv_cache_spec",
    "kv_replication",
    "kv_scales_sharding",
    "kv_sharding",
    "logits_shardings",
    "make_mesh",
    "param_shardings",
    "replicated",
    "shard_attention",
    "shard_params",
    "step_shardings",
]
