"""How is a batch's LoRA delta computed? For every token at once, whatever mix of adapters the batch holds.

Each token t carries a slot id (0: no adapter, 1..L: an adapter's device slot); `token_weights` turns the ids
into `w [T, L]`: the slot's scaling in column `slot - 1` and 0 elsewhere (a row of zeros for slot 0, which has
no arrays at all: `paged_jax.lora.weights`). A projection's delta is then two matmuls over all L slots together
(the one-hot formulation of BGMV that tpu-inference uses):

    shrink   u[t, l, :] = (x[t] @ A[l]) * w[t, l]            x [T, in] @ A [in, L * R] -> [T, L, R]
    expand   delta[t]   = sum_l u[t, l, :] @ B[l]            [T, L * R] @ B [L * R, out] -> [T, out]

so a token only ever receives its own adapter's `scaling * B(A(x))` (PEFT's formula) and the executable's
shapes depend on (T, L, R) alone: changing which adapters run never recompiles. A step where no token has an
adapter skips the deltas (`LoraLayer.active`, a `lax.cond` around each projection group's delta: the base
model's work alone).

Projections that read the same input are one group, one shrink and one expand: q/k/v, and gate/up. The shrink
computes the group's projections side by side ([T, 3, L, R], [T, 2, L, R]); the expand is one matmul batched
over the group's outputs, each batch entry contracting its own projection's u with its own B, and its result
lands on the base projection's fused output before that is split: gate/up's [T, 2, I], and q/k/v's
[T, Hkv, G + 2, D] (per KV head its G query heads, then K, then V: `paged_jax.model.layers.fuse_qkv`), where
the batch runs over the G + 2 heads of a KV head, the query's u repeated for its G heads. Each output element
is the same sum over (L, R) as one matmul per projection would compute, and a layer's deltas are two matmuls
per group (8 in all), with no per-projection slices of u: fewer and smaller programs for XLA to compile (the
start-up a LoRA engine pays beyond the base model's). The other formulation, a gather of every token's own
A and B (`A[slots] [T, in, R]`), reads T copies of the weights instead of L; `scripts/bench/bench_lora.py`
measures both and docs/benchmarks/lora.md gives the figures behind this choice.

The shrink is accumulated in float32 and its result cast to the activation dtype before the expand (PEFT runs
`lora_B(lora_A(x))` in the adapter dtype); the delta is added to the base projection's output in that dtype.
The functions are called from `paged_jax.model.layers` (`qkv_projection`, `out_projection`, `gated_mlp`), each
with its layer's `LoraLayer`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from paged_jax.lora.weights import Arrays, Layer, LoraWeights

F32 = jnp.float32


@flax.struct.dataclass
class LoraLayer:
    """One layer's adapter arrays (`paged_jax.lora.weights`), the step's token weights `w` [T, L] float32 and
    `active` (a bool scalar): some token of the step has an adapter."""

    weights: Layer
    token_weights: jax.Array
    active: jax.Array

    @property
    def has_mlp(self) -> bool:
        return "gate_up_a" in self.weights


@flax.struct.dataclass
class LoraBatch:
    """A step's LoRA input: every slot's arrays and each token's slot id `slots` [T] int32 (0: no adapter)."""

    weights: LoraWeights
    slots: jax.Array

    def layers(self) -> LoraLayers:
        """Every layer's adapters for the step, `token_weights` and `active` computed once."""
        return LoraLayers(self.weights.arrays, token_weights(self.slots, self.weights.scaling), jnp.any(self.slots > 0))


@flax.struct.dataclass
class LoraLayers:
    """Every layer's adapter arrays for one step, stacked [num_layers, ...] or one dict per layer
    (`paged_jax.lora.weights`), with the step's `token_weights` [T, L] and `active` shared by all layers."""

    arrays: Arrays
    token_weights: jax.Array
    active: jax.Array

    def at(self, layer: int | jax.Array) -> LoraLayer:
        """Layer `layer`'s `LoraLayer`: a Python int (the unrolled decoder: its own arrays, or its slice of the
        stacked ones) or a traced int32 scalar (a scan step: stacked arrays only)."""
        if isinstance(self.arrays, dict):
            return LoraLayer(jax.tree.map(lambda w: w[layer], self.arrays), self.token_weights, self.active)
        if not isinstance(layer, int):
            raise TypeError("LoRA arrays laid out per layer are indexed by a Python int (the unrolled decoder)")
        return LoraLayer(self.arrays[layer], self.token_weights, self.active)


def token_weights(slots: jax.Array, scaling: jax.Array) -> jax.Array:
    """w [T, L] float32: `scaling[slots[t] - 1]` at column `slots[t] - 1`, 0 elsewhere (all of row t when
    slots[t] is 0). slots [T] int32, scaling [L] (slot l + 1's)."""
    hit = slots[:, None] == jnp.arange(1, scaling.shape[0] + 1, dtype=slots.dtype)[None, :]
    return jnp.where(hit, scaling[None, :], 0.0).astype(F32)


def _shrink(x: jax.Array, a: jax.Array, w: jax.Array, contract: int) -> jax.Array:
    """x [T, *in] contracted with a [*in, *k, L, R] over `contract` axes, times w [T, L]: [T, *k, L, R] in x.dtype."""
    dims = ((tuple(range(1, 1 + contract)), tuple(range(contract))), ((), ()))
    u = jax.lax.dot_general(x, a, dims, preferred_element_type=F32)  # [T, *k, S, R]
    w = w.reshape(w.shape[0], *([1] * (u.ndim - 3)), w.shape[1], 1)
    return (u * w).astype(x.dtype)


def _expand(u: jax.Array, b: jax.Array) -> jax.Array:
    """u [T, L, R] with b [L, R, *out] -> [T, *out] (L and R contracted together) in u.dtype."""
    dims = (((1, 2), (0, 1)), ((), ()))
    return jax.lax.dot_general(u, b, dims, preferred_element_type=F32).astype(u.dtype)


def _expand_group(u: jax.Array, b: jax.Array) -> jax.Array:
    """u [T, P, L, R] with b [P, L, R, *out], batched over the P projections: [T, P, *out] in u.dtype, entry p
    contracting u[:, p] with b[p] over (L, R)."""
    dims = (((2, 3), (1, 2)), ((1,), (0,)))
    out = jax.lax.dot_general(u, b, dims, preferred_element_type=F32)  # [P, T, *out]
    return jnp.moveaxis(out, 0, 1).astype(u.dtype)


def _when_active(lora: LoraLayer, add, base: jax.Array) -> jax.Array:
    """`add(base)` (the base output plus its delta) when some token has an adapter, else `base` unchanged."""
    return jax.lax.cond(lora.active, add, lambda b: b, base)


def add_qkv(x: jax.Array, qkv: jax.Array, lora: LoraLayer) -> jax.Array:
    """The fused q/k/v output qkv [T, Hkv, G + 2, D] (`paged_jax.model.layers.fuse_qkv` layout) plus its deltas
    for x [T, H]: one shrink for q, k and v, one expand batched over each KV head's G + 2 heads."""

    def add(qkv):
        lw = lora.weights
        u = _shrink(x, lw["qkv_a"], lora.token_weights, 1)  # [T, 3, L, R]: q, k, v
        group = qkv.shape[2] - 2
        heads = jnp.concatenate([jnp.repeat(u[:, :1], group, axis=1), u[:, 1:]], axis=1)  # [T, G + 2, L, R]
        return qkv + jnp.moveaxis(_expand_group(heads, lw["qkv_b"]), 1, 2)  # [T, G + 2, Hkv, D] -> qkv's layout

    return _when_active(lora, add, qkv)


def add_o(y: jax.Array, out: jax.Array, lora: LoraLayer) -> jax.Array:
    """o_proj's output y [T, H] plus its delta for the attention output out [T, Hq, D]."""

    def add(y):
        return y + _expand(_shrink(out, lora.weights["o_a"], lora.token_weights, 2), lora.weights["o_b"])

    return _when_active(lora, add, y)


def add_gate_up(x: jax.Array, gate_up: jax.Array, lora: LoraLayer) -> jax.Array:
    """The fused gate/up output gate_up [T, 2, I] plus its deltas for x [T, H]: one shrink, one expand."""

    def add(gate_up):
        u = _shrink(x, lora.weights["gate_up_a"], lora.token_weights, 1)  # [T, 2, L, R]
        return gate_up + _expand_group(u, lora.weights["gate_up_b"])

    return _when_active(lora, add, gate_up)


def add_down(y: jax.Array, h: jax.Array, lora: LoraLayer) -> jax.Array:
    """down_proj's output y [T, H] plus its delta for its input h [T, I]."""

    def add(y):
        return y + _expand(_shrink(h, lora.weights["down_a"], lora.token_weights, 1), lora.weights["down_b"])

    return _when_active(lora, add, y)


__all__ = ["LoraBatch", "LoraLayer", "LoraLayers", "add_down", "add_gate_up", "add_o", "add_qkv", "token_weights"]
