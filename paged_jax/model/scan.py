"""Which decoders run their layers as one `lax.scan` step, and the stacked parameter tree that scan reads.

Why: an unrolled decoder traces and compiles every layer of every step shape, so start-up grows with depth;
scanned, the layer body is traced and compiled once and the step's compile time barely depends on depth.

Scanned tree: every `layers_{i}` subtree of the per-layer tree (the one loaders, checkpoints, LoRA and
quantization produce) stacked leaf by leaf on a new leading layer axis under one key, `layers`:

    layers/input_layernorm/weight  [L, H]
    layers/self_attn/qkv_proj      [L, H, Hkv, G + 2, D]   (a `QuantizedWeight`: values and scales both [L, ...])
    ...
    embed_tokens, norm, lm_head    as before

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


def use_scan(scan_layers: str) -> bool:
    """Whether a runner scans: `scan_layers` "off" never, "on" and "auto" always (every model scans).

    On every platform: on CPU too the scan pays for a real model (one layer body compiled instead of L; XLA:CPU
    copies each layer's weight slice before its dot, which a quiet machine reads back from cache:
    `scripts/startup_time.py --layers`); "off" stays for the few-layer models and loaded machines where the
    unrolled decode step is faster (README)."""
    if scan_layers not in SCAN_CHOICES:
        raise ValueError(f"scan_layers: must be one of {SCAN_CHOICES}, got {scan_layers!r}")
    return scan_layers != "off"


def is_stacked(params: Params) -> bool:
    return LAYERS in params["params"]


def stack_layers(params: Params) -> Params:
    """The scanned tree (module docstring) from the per-layer one; other leaves are shared, not copied.
    Works on concrete arrays and under `jax.eval_shape` / `jit`."""
    tree = dict(params["params"])
    names = sorted((k for k in tree if k.startswith("layers_")), key=lambda k: int(k.removeprefix("layers_")))
    if not names:
        raise ValueError("stack_layers: no layers_{i} entries in the parameter tree")
    layers = [tree.pop(name) for name in names]
    tree[LAYERS] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return {"params": tree}


def unstack_layers(params: Params) -> Params:
    """The per-layer tree from the scanned one (the inverse of `stack_layers`, exact)."""
    tree = dict(params["params"])
    stacked = tree.pop(LAYERS)
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    for i in range(num_layers):
        tree[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return {"params": tree}


__all__ = [
    "LAYERS",
    "SCAN_CHOICES",
    "LayerGroup",
    "is_stacked",
    "layer_groups",
    "stack_layers",
    "unstack_layers",
    "use_scan",
]
