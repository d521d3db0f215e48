"""Where do adapters live on the device? Stacked arrays with one slot per resident adapter.

Every adapted projection has one A and one B array for all layers, stacked on a leading layer axis (as the
scanned decoder stacks its weights, `paged_jax.model.scan`: a scan step indexes its layer's slice), with a slot
axis of `max_loras` entries: entry l holds device slot l + 1 (slot 0, "no adapter", has no entry, so the one-hot
matmuls never compute it; a token of slot 0 has a zero weight row, `paged_jax.lora.delta.token_weights`). Ranks
are padded with zeros to `max_lora_rank` (exact: padded columns of A meet padded rows of B). One layer's slice
(L slots, R rank; every array has a leading [num_layers] axis before these):

    qkv_a [H, 3, L, R]    q_b [L, R, Hq, D]    k_b, v_b [L, R, Hkv, D]
    o_a   [Hq, D, L, R]   o_b [L, R, H]
    gate_up_a [H, 2, L, R]    gate_b, up_b [L, R, I]    down_a [I, L, R]    down_b [L, R, H]

The axes are laid out for the two matmuls of `paged_jax.lora.delta`: A's input axes lead and (L, R) trail, so
the shrink `x [T, in] @ A [in, L * R]` needs no transpose; B's (L, R) lead, so the expand contracts them as one
axis of L * R. A's slot axis is therefore second to last, B's the first after the layer axis (`slot_axis`).
q/k/v share one A array (one shrink matmul reads x once) as gate/up do; their B arrays stay apart so each delta
lands on its own output (`paged_jax.lora.delta`). MoE models have the attention arrays only. `scaling` [S]
float32 holds each slot's `lora_alpha / r` (entry l for slot l + 1; 0 for empty slots).

Tensor parallelism shards each array like the base weight it adapts (`paged_jax.model.partition`): B of q/k/v
by heads and gate/up by columns (as qkv_proj / gate_up_proj are split), A of o and down by their input axis
(as o_proj / down_proj are split by rows, so the shrink's partial sums are all-reduced like the base output);
the other halves are replicated. With KV heads repeated for TP (`paged_jax.worker.sharding.expand_kv_heads`), k_b and
v_b repeat them alike.

Loading an adapter into a slot is one jitted in-place update (`write_slot`, the slot index a traced scalar), so
which adapters are resident never changes an executable's shapes.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from paged_jax.config import ModelConfig
from paged_jax.lora.peft import LoraAdapter

Layer = dict[str, Any]


@flax.struct.dataclass
class LoraWeights:
    """Every slot's adapter weights: `arrays` by name, each [num_layers, ...] (module docstring); `scaling` [L]
    float32."""

    arrays: Layer
    scaling: jax.Array

    @property
    def max_loras(self) -> int:
        return self.scaling.shape[0]


def layer_shapes(config: ModelConfig, max_loras: int, max_rank: int) -> Layer:
    """Shapes of one layer's slice of the arrays for `max_loras` slots (module docstring, without the layer axis);
    attention only for MoE models."""
    s, r = max_loras, max_rank
    h, d, hq, hkv, i = (
        config.hidden_size,
        config.head_dim,
        config.num_heads,
        config.num_kv_heads,
        config.intermediate_size,
    )
    shapes = {
        "qkv_a": (h, 3, s, r),
        "q_b": (s, r, hq, d),
        "k_b": (s, r, hkv, d),
        "v_b": (s, r, hkv, d),
        "o_a": (hq, d, s, r),
        "o_b": (s, r, h),
    }
    if not config.is_moe:
        shapes.update(
            {
                "gate_up_a": (h, 2, s, r),
                "gate_b": (s, r, i),
                "up_b": (s, r, i),
                "down_a": (i, s, r),
                "down_b": (s, r, h),
            }
        )
    return shapes


def slot_axis(name: str, ndim: int) -> int:
    """The slot axis of stacked array `name` of `ndim` axes (module docstring): second to last for A, the first
    after the layer axis for B."""
    return ndim - 2 if name.endswith("_a") else 1


_SPECS = {
    "qkv_a": lambda tp: P(),
    "q_b": lambda tp: P(None, None, tp, None),
    "k_b": lambda tp: P(None, None, tp, None),
    "v_b": lambda tp: P(None, None, tp, None),
    "o_a": lambda tp: P(tp, None, None, None),
    "o_b": lambda tp: P(),
    "gate_up_a": lambda tp: P(),
    "gate_b": lambda tp: P(None, None, tp),
    "up_b": lambda tp: P(None, None, tp),
    "down_a": lambda tp: P(tp, None, None),
    "down_b": lambda tp: P(),
}


def partition_specs(config: ModelConfig, max_loras: int, max_rank: int, tp_axis: str = "tp") -> LoraWeights:
    """A `LoraWeights` of `PartitionSpec` leaves (module docstring)."""
    specs = {k: P(None, *_SPECS[k](tp_axis)) for k in layer_shapes(config, max_loras, max_rank)}
    return LoraWeights(specs, P())  # type: ignore[arg-type]  # partition specs stand in for arrays


def abstract_weights(config: ModelConfig, max_loras: int, max_rank: int) -> LoraWeights:
    """`jax.ShapeDtypeStruct` leaves of the stacked arrays in the model dtype (scaling float32)."""
    dtype, n = jnp.dtype(config.dtype), config.num_layers
    arrays = {k: jax.ShapeDtypeStruct((n, *v), dtype) for k, v in layer_shapes(config, max_loras, max_rank).items()}
    scaling = jax.ShapeDtypeStruct((max_loras,), jnp.float32)
    return LoraWeights(arrays, scaling)  # type: ignore[arg-type]  # abstract leaves stand in for arrays


def allocate(config: ModelConfig, max_loras: int, max_rank: int, shardings: LoraWeights | None = None) -> LoraWeights:
    """All `max_loras` slots zeroed (no adapter anywhere), placed by `shardings` when given."""
    shapes = abstract_weights(config, max_loras, max_rank)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
    return zeros if shardings is None else jax.device_put(zeros, shardings)


def slot_arrays(adapter: LoraAdapter, config: ModelConfig, max_rank: int) -> tuple[Layer, np.float32]:
    """One slot's worth of the arrays (the module docstring's stacked shapes without the slot axis) in the model
    dtype, zero where the adapter adapts nothing, plus its scaling. `config` is the run config: its KV heads may
    be the adapter's repeated for tensor parallelism."""
    dtype = jnp.dtype(config.dtype)
    shapes = {k: _drop(v, slot_axis(k, len(v) + 1) - 1) for k, v in layer_shapes(config, 1, max_rank).items()}
    rank = adapter.rank
    layers = []
    for mods in adapter.layers:
        arrays = {k: np.zeros(v, np.float32) for k, v in shapes.items()}
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            if name in mods:
                a, b = mods[name]
                arrays["qkv_a"][:, j, :rank] = a
                if name != "q_proj":
                    b = np.repeat(b, config.num_kv_heads // b.shape[1], axis=1)
                arrays[name[0] + "_b"][:rank] = b
        if "o_proj" in mods:
            a, b = mods["o_proj"]
            arrays["o_a"][..., :rank], arrays["o_b"][:rank] = a, b
        for j, name in enumerate(("gate_proj", "up_proj")):
            if name in mods:
                a, b = mods[name]
                arrays["gate_up_a"][:, j, :rank], arrays[name[:-5] + "_b"][:rank] = a, b
        if "down_proj" in mods:
            a, b = mods["down_proj"]
            arrays["down_a"][:, :rank], arrays["down_b"][:rank] = a, b
        layers.append(arrays)
    return {k: np.stack([a[k] for a in layers]).astype(dtype) for k in shapes}, np.float32(adapter.scaling)


def _drop(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return shape[:axis] + shape[axis + 1 :]


def write_slot(weights: LoraWeights, slot: jax.Array, arrays: Layer, scaling: jax.Array) -> LoraWeights:
    """`weights` with device slot `slot` (an int32 scalar in 1..max_loras: entry slot - 1) replaced by one slot's
    `arrays` (`slot_arrays`) and `scaling`; the runner jits it with `weights` donated, so the update is in place
    and one executable serves every slot."""
    index = slot - 1

    def put(name: str, w: jax.Array, x: jax.Array) -> jax.Array:
        axis = slot_axis(name, w.ndim)
        return jax.lax.dynamic_update_index_in_dim(w, x.astype(w.dtype), index, axis)

    new = {k: put(k, w, arrays[k]) for k, w in weights.arrays.items()}
    return LoraWeights(new, weights.scaling.at[index].set(scaling))


__all__ = [
    "LoraWeights",
    "abstract_weights",
    "allocate",
    "layer_shapes",
    "partition_specs",
    "slot_arrays",
    "slot_axis",
    "write_slot",
]
