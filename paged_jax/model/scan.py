"""Which decoders run their layers as one `lax.scan` step, and the stacked parameter tree that scan reads.

Why: an unrolled decoder traces and compiles every layer of every step shape, so start-up grows with depth;
scanned, the layer body is traced and compiled once and the step's compile time barely depends on depth.

Scanned tree: every `layers_{i}` subtree of the per-layer tree (the one loaders, checkpoints, LoRA and
quantization produce) stacked leaf by leaf on a new leading layer axis under one key, `layers`:

    layers/input_layernorm/weight  [L, H]
    layers/self_attn/qkv_proj      [L, H, Hkv, G + 2, D]   (a `QuantizedWeight`: values and scales both [L, ...])
    ...
    embed_tokens, norm, lm_head    as before

On TPU `layers/mlp/gate_up_proj` is stacked as [L, 2, H, I] rather than [L, H, 2, I], and `qkv_proj` as
[L, Hkv, G + 2, H, D] (`STACKED_ORDERS` says why); the scan step transposes each layer's slice back, which XLA
folds into the dot (qkv_proj's written batched over heads: `head_batched_qkv`).

The stored form (orbax checkpoints, HF/GGUF import) stays per layer, so every checkpoint restores for either
path; `stack_layers` runs once when a runner takes the parameters.

Every family scans, in layer groups (`layer_groups`): where layers differ, they differ only by their sliding
window (Gemma 2/3's pattern: the window is the kernels' static argument and it picks the layer's RoPE base), and
the window pattern is periodic, so a scan step runs one period of layers (Gemma 2: [sliding, global]; Gemma 3:
five sliding then one global), each with its own static window and RoPE table, and a depth that is no multiple
of the period ends in a second group (Gemma 3 with 26 layers: 4 x 6, then 2 x 1). Uniform models are one group
of one layer. Why groups and not the window as scanned data: a traced window would become a runtime operand of
every backend's kernel (Pallas TPU and GPU, the C++ CPU kernel, the XLA path), lose their static page-range
skipping outside the window and need new kernel variants; groups keep every kernel call as it is, at a compile
cost of one period of layers (at most six), still independent of depth.

LoRA: the adapters' slots are stacked the same way (`paged_jax.lora.weights`: [L, ...]) and each scan step
indexes its layer's slice like the base weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.config import ModelConfig
from paged_jax.config.engine import SCAN_CHOICES

LAYERS = "layers"  # the key of the stacked subtree

Params = dict[str, Any]


@dataclass(frozen=True)
class LayerGroup:
    """`count` scan steps of `size` layers each from layer `start`: step g runs layers start + g * size + j
    (j < size), layer j with the window of layer start + j (the same for every g)."""

    start: int
    size: int
    count: int


def layer_groups(config: ModelConfig) -> tuple[LayerGroup, ...]:
    """The scan's groups (module docstring): from the first layer not yet covered, the shortest period of the
    remaining layers' windows, repeated as often as it fits; then the same for what is left."""
    windows = [config.layer_sliding_window(i) for i in range(config.num_layers)]
    groups, start = [], 0
    while start < len(windows):
        rest = windows[start:]
        size = next(q for q in range(1, len(rest) + 1) if all(w == rest[i % q] for i, w in enumerate(rest)))
        groups.append(LayerGroup(start, size, len(rest) // size))
        start += size * (len(rest) // size)
    return tuple(groups)


def use_scan(scan_layers: str, platform: str, grouped: bool = False) -> bool:
    """Whether a runner on `platform` ("cpu", "tpu", "gpu") scans: "off" never, "on" always, "auto" on TPU and
    GPU, and on CPU only for a model whose KV is in several cache groups (`grouped`: sliding-window layers with
    hybrid KV, `paged_jax.kv_cache.groups`), since the groups' per-layer tables are read by the scanned decoder.

    Why not on CPU: XLA:CPU's dots cannot read a slice of a stacked array in place, so a scanned step copies
    every layer's weight slices into buffers of their own before its dots (a dynamic-slice fusion per weight,
    also when the scan is unrolled), which reads the layer weights twice and writes them once more on every step;
    unrolled, each dot reads its own per-layer parameter. The compiled step is checked for such copies
    (`paged_jax.worker.hlo_audit.weight_copies`, `tests/model/test_cpu_step.py`) and the two compared in
    `scripts/bench/bench_cpu_step.py`. "on" still scans on CPU (one layer body compiled instead of L: a shorter
    start-up for deep models, at that per-step cost)."""
    if scan_layers not in SCAN_CHOICES:
        raise ValueError(f"scan_layers: must be one of {SCAN_CHOICES}, got {scan_layers!r}")
    return scan_layers == "on" or (scan_layers == "auto" and (platform != "cpu" or grouped))


def is_stacked(params: Params) -> bool:
    return LAYERS in params["params"]


# A stacked leaf may keep its axes in another order than the per-layer one, chosen per platform so that each
# layer's slice is an array the dot reads in place. An order is a tuple of (weight name, permutation of the
# per-layer axes); the scan step transposes each slice back (`to_layer_order`), which XLA folds into the dot.
# TPU: gate_up_proj [H, 2, I] stacked as [L, 2, H, I]. In the per-layer order, XLA:TPU tiles the stacked
# array's two minor axes (2, I) as T(2,128) and does not fuse a dynamic-slice of that tiling into the dot:
# each layer's slice was written to HBM before its dot (Llama-3.1-8B bf16: 7 GiB per decode step); stacked
# as [L, 2, H, I] the minor axes are (H, I), tiled T(8,128), and the dot reads the slice in place.
# TPU: qkv_proj [H, Hkv, G + 2, D] stacked as [L, Hkv, G + 2, H, D]. In the per-layer order the minor axes
# (G + 2, D) are short rows (Gemma 3 4B: 4 x 256, tiled T(4,128)) that XLA:TPU relayouts for the decode dot,
# which wants (H, D) tiles with the output axes in their order: the whole stacked qkv_proj (680 MiB) was
# copied every Gemma decode step, and each Llama-3.1-8B slice was relaid out into VMEM on its way in; stacked
# so, both read in place. For a prefill or verify step (hundreds of tokens) XLA:TPU lays the plain dot's output
# out T-minor and then wants (D, H) tiles, relaying out each slice (Llama-3.1-8B: 1.5 GiB per step); written
# as a dot batched over (Hkv, G + 2) with x broadcast (`head_batched_qkv`, `paged_jax.model.quant.dot`'s
# `batch`), whose operands keep their head axes outermost, every token count reads the slice in place.
# The stacked partition specs are the per-layer ones permuted likewise, the layer axis in front
# (`paged_jax.model.partition.param_partition_specs`' `order`). GPU and CPU keep the per-layer order (a GPU
# GEMM reads [H, 2 * I] rows in place; [2, H, I] would need a transpose).
StackedOrder = tuple[tuple[str, tuple[int, ...]], ...]
STACKED_ORDERS: dict[str, StackedOrder] = {"tpu": (("gate_up_proj", (1, 0, 2)), ("qkv_proj", (1, 2, 0, 3)))}


def stacked_order(platform: str) -> StackedOrder:
    """The stacked axis order of `platform` ("cpu", "tpu", "gpu"); () keeps every leaf in the per-layer order."""
    return STACKED_ORDERS.get(platform, ())


def head_batched_qkv(order: StackedOrder, head_dim: int) -> bool:
    """Whether the scan step writes the QKV matmul batched over (Hkv, G + 2) (`paged_jax.model.layers.
    qkv_projection`): where `order` stacks qkv_proj head-major ([L, Hkv, G + 2, H, D]) and heads are at most
    128 wide. That form reads such a slice in place for any token count on TPU (the comment above
    `STACKED_ORDERS`); at head_dim 256 (Gemma) XLA:TPU copies its slices out in a prefill step (Gemma-3-4B:
    780 MiB per step, where the plain dot relays the whole stacked weight out once, 260 MiB:
    docs/benchmarks/compile_checks.md)."""
    return dict(order).get("qkv_proj") == (1, 2, 0, 3) and head_dim <= 128


def _key_name(entry: Any) -> str:
    return str(getattr(entry, "key", getattr(entry, "name", entry)))


def _reorder(tree: Any, order: StackedOrder, inverse: bool, layer_axis: bool) -> Any:
    """`tree` with the leaves named in `order` (a `QuantizedWeight`'s values by its weight's name; scales keep
    their axes) permuted to the stacked order, or back with `inverse`; `layer_axis`: a leading layer axis."""
    perms = dict(order)

    def one(path, leaf):
        name = _key_name(path[-1])
        if name == "values" and len(path) > 1:  # a QuantizedWeight's values: the weight's name is one up
            name = _key_name(path[-2])
        perm = perms.get(name)
        if perm is None:
            return leaf
        if inverse:
            perm = tuple(int(i) for i in np.argsort(perm))
        if layer_axis:
            perm = (0, *(a + 1 for a in perm))
        if leaf.ndim != len(perm):
            raise ValueError(f"{jax.tree_util.keystr(path)}: {leaf.ndim} axes, the stacked order permutes {len(perm)}")
        return jnp.transpose(leaf, perm)

    return jax.tree_util.tree_map_with_path(one, tree)


def to_stacked_order(stacked: Any, order: StackedOrder) -> Any:
    """A stacked subtree ([L, ...] leaves in the per-layer axis order) in `order`."""
    return _reorder(stacked, order, inverse=False, layer_axis=True) if order else stacked


def to_layer_order(layer: Any, order: StackedOrder) -> Any:
    """One layer's slice of a stacked subtree in `order` (layer axis dropped) back in the per-layer axis order."""
    return _reorder(layer, order, inverse=True, layer_axis=False) if order else layer


def stack_layers(params: Params, order: StackedOrder = ()) -> Params:
    """The scanned tree (module docstring) from the per-layer one, its leaves in `order` (`stacked_order`);
    other leaves are shared, not copied. Works on concrete arrays and under `jax.eval_shape` / `jit`."""
    tree = dict(params["params"])
    names = sorted((k for k in tree if k.startswith("layers_")), key=lambda k: int(k.removeprefix("layers_")))
    if not names:
        raise ValueError("stack_layers: no layers_{i} entries in the parameter tree")
    layers = [tree.pop(name) for name in names]
    tree[LAYERS] = to_stacked_order(jax.tree.map(lambda *xs: jnp.stack(xs), *layers), order)
    return {"params": tree}


def unstack_layers(params: Params, order: StackedOrder = ()) -> Params:
    """The per-layer tree from the scanned one stacked in `order` (the inverse of `stack_layers`, exact)."""
    tree = dict(params["params"])
    stacked = _reorder(tree.pop(LAYERS), order, inverse=True, layer_axis=True) if order else tree.pop(LAYERS)
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    for i in range(num_layers):
        tree[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return {"params": tree}


__all__ = [
    "LAYERS",
    "SCAN_CHOICES",
    "STACKED_ORDERS",
    "LayerGroup",
    "StackedOrder",
    "head_batched_qkv",
    "is_stacked",
    "layer_groups",
    "stack_layers",
    "stacked_order",
    "to_layer_order",
    "to_stacked_order",
    "unstack_layers",
    "use_scan",
]
