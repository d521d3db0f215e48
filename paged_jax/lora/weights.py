"""Where do adapters live on the device? Arrays with one slot per resident adapter, per projection group.

Every adapted projection group has one A and one B array per layer, with a slot axis of `max_loras` entries:
entry l holds device slot l + 1 (slot 0, "no adapter", has no entry, so the one-hot matmuls never compute it; a
token of slot 0 has a zero weight row, `paged_jax.lora.delta.token_weights`). Ranks are padded with zeros to
`max_lora_rank` (exact: padded columns of A meet padded rows of B). One layer's arrays (L slots, R rank;
G = Hq / Hkv query heads per KV head):

    qkv_a [H, 3, L, R]        qkv_b [G + 2, L, R, Hkv, D]
    o_a   [Hq, D, L, R]       o_b [L, R, H]
    gate_up_a [H, 2, L, R]    gate_up_b [2, L, R, I]        down_a [I, L, R]    down_b [L, R, H]

The axes are laid out for the two matmuls of `paged_jax.lora.delta`: A's input axes lead and (L, R) trail, so
the shrink `x [T, in] @ A [in, L * R]` needs no transpose; B's (L, R) lead its output axes, so the expand
contracts them as one axis of L * R (`SLOT_AXIS`: each array's slot axis, counted from the end). A projection
group reads one input, so it has one A array (one shrink matmul, x read once) and one B array (one expand
matmul, batched over the group's outputs): gate/up's B is batched over its two projections, and q/k/v's over
the G + 2 heads of each KV head's slice of the fused projection (`paged_jax.model.layers.fuse_qkv`: G query
heads, then K, then V), so the delta lands on the fused output [T, Hkv, G + 2, D] in its layout, before it is
split. qkv_b[g, :, :, h] is q_b's head h * G + g for g < G, k_b's head h for g = G, v_b's for g = G + 1. MoE
models have the attention arrays only. `scaling` [L] float32 holds each slot's `lora_alpha / r` (entry l for
slot l + 1; 0 for empty slots).

Two layouts of the same arrays (`stacked`): the scanned decoder (`paged_jax.model.scan`) reads them stacked on
a leading layer axis, one array per name, a scan step indexing its layer's slice like the base weights; the
unrolled decoder reads one dict of arrays per layer, so each layer's matmuls read their own arrays in place
(XLA:CPU copies a slice of a stacked array into a buffer of its own before a dot: every array of every layer,
every step, each copy one more fusion to compile).

Tensor parallelism shards each array like the base weight it adapts (`paged_jax.model.partition`): B of q/k/v
by KV heads (as the fused qkv_proj is split) and gate/up by columns, A of o and down by their input axis (as
o_proj / down_proj are split by rows, so the shrink's partial sums are all-reduced like the base output); the
other halves are replicated. With KV heads repeated for TP (`paged_jax.worker.sharding.expand_kv_heads`), the
k and v heads of qkv_b repeat them alike.

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
Arrays = Layer | tuple[Layer, ...]  # stacked: one [num_layers, ...] array per name; else one Layer per layer

# Each array's slot axis counted from its end (the same with or without a leading layer axis).
SLOT_AXIS = {
    "qkv_a": -2,
    "qkv_b": -4,
    "o_a": -2,
    "o_b": -3,
    "gate_up_a": -2,
    "gate_up_b": -3,
    "down_a": -2,
    "down_b": -3,
}


@flax.struct.dataclass
class LoraWeights:
    """Every slot's adapter weights: `arrays` by name, stacked (a dict of [num_layers, ...] arrays) or per layer
    (a tuple of one dict per layer) (module docstring); `scaling` [L] float32."""

    arrays: Arrays
    scaling: jax.Array

    @property
    def max_loras(self) -> int:
        return self.scaling.shape[0]


def layer_shapes(config: ModelConfig, max_loras: int, max_rank: int) -> Layer:
    """Shapes of one layer's arrays for `max_loras` slots (module docstring, without a layer axis); attention
    only for MoE models."""
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
        "qkv_b": (hq // hkv + 2, s, r, hkv, d),
        "o_a": (hq, d, s, r),
        "o_b": (s, r, h),
    }
    if not config.is_moe:
        shapes.update({"gate_up_a": (h, 2, s, r), "gate_up_b": (2, s, r, i), "down_a": (i, s, r), "down_b": (s, r, h)})
    return shapes


_SPECS = {
    "qkv_a": lambda tp: P(),
    "qkv_b": lambda tp: P(None, None, None, tp, None),
    "o_a": lambda tp: P(tp, None, None, None),
    "o_b": lambda tp: P(),
    "gate_up_a": lambda tp: P(),
    "gate_up_b": lambda tp: P(None, None, None, tp),
    "down_a": lambda tp: P(tp, None, None),
    "down_b": lambda tp: P(),
}


def _layout(config: ModelConfig, layer: Layer, stacked: bool) -> Arrays:
    """One tree by name as the arrays of `stacked`: itself (its leaves carry the layer axis), or one copy per
    layer."""
    return layer if stacked else tuple(dict(layer) for _ in range(config.num_layers))


def partition_specs(
    config: ModelConfig, max_loras: int, max_rank: int, stacked: bool, tp_axis: str = "tp"
) -> LoraWeights:
    """A `LoraWeights` of `PartitionSpec` leaves (module docstring)."""
    lead = (None,) if stacked else ()
    specs = {k: P(*lead, *_SPECS[k](tp_axis)) for k in layer_shapes(config, max_loras, max_rank)}
    return LoraWeights(_layout(config, specs, stacked), P())  # type: ignore[arg-type]  # partition specs stand in for arrays


def abstract_weights(config: ModelConfig, max_loras: int, max_rank: int, stacked: bool) -> LoraWeights:
    """`jax.ShapeDtypeStruct` leaves of the arrays in the model dtype (scaling float32)."""
    dtype, lead = jnp.dtype(config.dtype), (config.num_layers,) if stacked else ()
    layer = {k: jax.ShapeDtypeStruct((*lead, *v), dtype) for k, v in layer_shapes(config, max_loras, max_rank).items()}
    scaling = jax.ShapeDtypeStruct((max_loras,), jnp.float32)
    return LoraWeights(_layout(config, layer, stacked), scaling)  # type: ignore[arg-type]  # abstract leaves stand in for arrays


def abstract_slot(config: ModelConfig, max_rank: int, stacked: bool) -> Arrays:
    """`jax.ShapeDtypeStruct` leaves of one slot's arrays (`slot_arrays`' tree): each array without its slot axis."""

    def drop(layer: Layer) -> Layer:
        return {k: jax.ShapeDtypeStruct(_drop(x.shape, SLOT_AXIS[k]), x.dtype) for k, x in layer.items()}

    one = abstract_weights(config, 1, max_rank, stacked).arrays
    return drop(one) if isinstance(one, dict) else tuple(drop(layer) for layer in one)


def allocate(
    config: ModelConfig, max_loras: int, max_rank: int, stacked: bool, shardings: LoraWeights | None = None
) -> LoraWeights:
    """All `max_loras` slots zeroed (no adapter anywhere), placed by `shardings` when given."""
    shapes = abstract_weights(config, max_loras, max_rank, stacked)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
    return zeros if shardings is None else jax.device_put(zeros, shardings)


def slot_arrays(adapter: LoraAdapter, config: ModelConfig, max_rank: int, stacked: bool) -> tuple[Arrays, np.float32]:
    """One slot's worth of the arrays (the module docstring's shapes without the slot axis, in the layout of
    `stacked`) in the model dtype, zero where the adapter adapts nothing, plus its scaling. `config` is the run
    config: its KV heads may be the adapter's repeated for tensor parallelism."""
    dtype = jnp.dtype(config.dtype)
    shapes = {k: _drop(v, SLOT_AXIS[k]) for k, v in layer_shapes(config, 1, max_rank).items()}
    rank, hkv = adapter.rank, config.num_kv_heads
    group = config.num_heads // hkv
    layers = []
    for mods in adapter.layers:
        arrays = {k: np.zeros(v, np.float32) for k, v in shapes.items()}
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            if name in mods:
                a, b = mods[name]
                arrays["qkv_a"][:, j, :rank] = a
                if name == "q_proj":  # [r, Hq, D] -> [G, r, Hkv, D]: head h * G + g at [g, :, h]
                    b = b.reshape(rank, hkv, group, -1).transpose(2, 0, 1, 3)
                else:  # [r, Hkv', D] -> [1, r, Hkv, D], KV heads repeated for tensor parallelism
                    b = np.repeat(b, hkv // b.shape[1], axis=1)[None]
                heads = slice(0, group) if name == "q_proj" else slice(group + j - 1, group + j)
                arrays["qkv_b"][heads, :rank] = b
        if "o_proj" in mods:
            a, b = mods["o_proj"]
            arrays["o_a"][..., :rank], arrays["o_b"][:rank] = a, b
        for j, name in enumerate(("gate_proj", "up_proj")):
            if name in mods:
                a, b = mods[name]
                arrays["gate_up_a"][:, j, :rank], arrays["gate_up_b"][j, :rank] = a, b
        if "down_proj" in mods:
            a, b = mods["down_proj"]
            arrays["down_a"][:, :rank], arrays["down_b"][:rank] = a, b
        layers.append({k: v.astype(dtype) for k, v in arrays.items()})
    scaling = np.float32(adapter.scaling)
    if stacked:
        return {k: np.stack([a[k] for a in layers]) for k in shapes}, scaling
    return tuple(layers), scaling


def _drop(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    axis %= len(shape)
    return shape[:axis] + shape[axis + 1 :]


def write_slot(weights: LoraWeights, slot: jax.Array, arrays: Arrays, scaling: jax.Array) -> LoraWeights:
    """`weights` with device slot `slot` (an int32 scalar in 1..max_loras: entry slot - 1) replaced by one slot's
    `arrays` (`slot_arrays`, the same layout) and `scaling`; the runner jits it with `weights` donated, so the
    update is in place and one executable serves every slot."""
    index = slot - 1

    def put(layer: Layer, new: Layer) -> Layer:
        return {
            k: jax.lax.dynamic_update_index_in_dim(w, new[k].astype(w.dtype), index, w.ndim + SLOT_AXIS[k])
            for k, w in layer.items()
        }

    if isinstance(weights.arrays, dict):
        assert isinstance(arrays, dict), "one slot's arrays are laid out as the weights are"
        updated: Arrays = put(weights.arrays, arrays)
    else:
        assert isinstance(arrays, tuple), "one slot's arrays are laid out as the weights are"
        updated = tuple(put(w, a) for w, a in zip(weights.arrays, arrays, strict=True))
    return LoraWeights(updated, weights.scaling.at[index].set(scaling))


__all__ = [
    "SLOT_AXIS",
    "Arrays",
    "LoraWeights",
    "abstract_slot",
    "abstract_weights",
    "allocate",
    "layer_shapes",
    "partition_specs",
    "slot_arrays",
    "write_slot",
]
