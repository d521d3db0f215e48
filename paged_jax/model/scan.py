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

Which families scan: those whose layers are the same function of their own weights, i.e. every layer has the
same sliding window (Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE: MoE in every layer, and any Gemma without a
window pattern). Gemma 2/3's alternating windows pick the kernel's static window and the RoPE base per layer;
they stay unrolled (`can_scan` False) rather than turning the window into a traced kernel operand on every
backend.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from paged_jax.config import ModelConfig
from paged_jax.config.engine import SCAN_CHOICES

LAYERS = "layers"  # the key of the stacked subtree

Params = dict[str, Any]


def can_scan(config: ModelConfig) -> bool:
    """True when every layer is the same function of its weights (one sliding window for all: module docstring)."""
    return len({config.layer_sliding_window(i) for i in range(config.num_layers)}) == 1


def use_scan(config: ModelConfig, scan_layers: str, lora: bool) -> bool:
    """Whether a runner scans: `scan_layers` "off" never, "on" always (ValueError naming the field where it
    cannot), "auto" when `can_scan` and LoRA is off (LoRA's slots are per-layer arrays: `paged_jax.lora.weights`).

    On every platform: on CPU too the scan pays for a real model (one layer body compiled instead of L; XLA:CPU
    copies each layer's weight slice before its dot, which a quiet machine reads back from cache:
    `scripts/startup_time.py --layers`); "off" stays for the few-layer models and loaded machines where the
    unrolled decode step is faster (README)."""
    if scan_layers not in SCAN_CHOICES:
        raise ValueError(f"scan_layers: must be one of {SCAN_CHOICES}, got {scan_layers!r}")
    possible = can_scan(config) and not lora
    if scan_layers == "on" and not possible:
        why = "LoRA adapters are per-layer arrays" if lora else "its layers differ (sliding-window pattern)"
        raise ValueError(f"scan_layers: 'on' is not possible for this model ({why}); use 'auto' or 'off'")
    if scan_layers == "auto":
        return possible
    return scan_layers == "on"


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
    "can_scan",
    "is_stacked",
    "stack_layers",
    "unstack_layers",
    "use_scan",
]
