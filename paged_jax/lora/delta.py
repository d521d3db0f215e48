"""How is a batch's LoRA delta computed? For every token at once, whatever mix of adapters the batch holds.

Each token t carries a slot id (0: no adapter, 1..L: an adapter's device slot); `token_weights` turns the ids
into `w [T, L]`: the slot's scaling in column `slot - 1` and 0 elsewhere (a row of zeros for slot 0, which has
no arrays at all: `paged_jax.lora.weights`). A projection's delta is then two matmuls over all L slots together
(the one-hot formulation of BGMV that tpu-inference uses):

    shrink   u[t, l, :] = (x[t] @ A[l]) * w[t, l]            x [T, in] @ A [in, L * R] -> [T, L, R]
    expand   delta[t]   = sum_l u[t, l, :] @ B[l]            [T, L * R] @ B [L * R, out] -> [T, out]

so a token only ever receives its own adapter's `scaling * B(A(x))` (PEFT's formula) and the executable's
shapes depend on (T, L, R) alone: changing which adapters run never recompiles. A step where no token has an
adapter skips the deltas (`LoraLayer.active`, a `lax.cond` around each projection's delta: the base model's
work alone). Projections that read the same input share one shrink: q/k/v one, gate/up one. The other formulation, a
gather of every token's own A and B (`A[slots] [T, in, R]`), reads T copies of the weights instead of L;
`scripts/bench/bench_lora.py` measures both and docs/benchmarks/lora.md gives the figures behind this choice.

The shrink is accumulated in float32 and its result cast to the activation dtype before the expand (PEFT runs
`lora_B(lora_A(x))` in the adapter dtype); the delta is added to the base projection's output in that dtype.
The functions are called from `paged_jax.model.layers` (`qkv_projection`, `out_projection`, `gated_mlp`), each
with its layer's `LoraLayer`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from paged_jax.lora.weights import Layer, LoraWeights

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
    """Every layer's adapter arrays for one step: `arrays` stacked [num_layers, ...] (`paged_jax.lora.weights`),
    with the step's `token_weights` [T, L] and `active` shared by all layers."""

    arrays: Layer
    token_weights: jax.Array
    active: jax.Array

    def at(self, layer: int | jax.Array) -> LoraLayer:
        """Layer `layer`'s `LoraLayer`: a Python int (the unrolled decoder) or a traced int32 scalar (a scan step)."""
        return LoraLayer(jax.tree.map(lambda w: w[layer], self.arrays), self.token_weights, self.active)


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


def _when_active(lora: LoraLayer, add, *base: jax.Array):
    """`add(*base)` (the base outputs plus their deltas) when some token has an adapter, else `base` unchanged."""

    def with_delta(*b: jax.Array) -> tuple[jax.Array, ...]:
        out = add(*b)
        return out if isinstance(out, tuple) else (out,)

    result = jax.lax.cond(lora.active, with_delta, lambda *b: b, *base)
    return result[0] if len(base) == 1 else result


def add_qkv(x: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, lora: LoraLayer):
    """q [T, Hq, D], k and v [T, Hkv, D] plus their deltas for x [T, H]: one shrink for all three."""

    def add(q, k, v):
        lw = lora.weights
        u = _shrink(x, lw["qkv_a"], lora.token_weights, 1)  # [T, 3, L, R]
        return q + _expand(u[:, 0], lw["q_b"]), k + _expand(u[:, 1], lw["k_b"]), v + _expand(u[:, 2], lw["v_b"])

    return _when_active(lora, add, q, k, v)


def add_o(y: jax.Array, out: jax.Array, lora: LoraLayer) -> jax.Array:
    """o_proj's output y [T, H] plus its delta for the attention output out [T, Hq, D]."""

    def add(y):
        return y + _expand(_shrink(out, lora.weights["o_a"], lora.token_weights, 2), lora.weights["o_b"])

    return _when_active(lora, add, y)


def add_gate_up(x: jax.Array, gate: jax.Array, up: jax.Array, lora: LoraLayer):
    """gate and up [T, I] plus their deltas for x [T, H]: one shrink for both."""

    def add(gate, up):
        lw = lora.weights
        u = _shrink(x, lw["gate_up_a"], lora.token_weights, 1)  # [T, 2, L, R]
        return gate + _expand(u[:, 0], lw["gate_b"]), up + _expand(u[:, 1], lw["up_b"])

    return _when_active(lora, add, gate, up)


def add_down(y: jax.Array, h: jax.Array, lora: LoraLayer) -> jax.Array:
    """down_proj's output y [T, H] plus its delta for its input h [T, I]."""

    def add(y):
        return y + _expand(_shrink(h, lora.weights["down_a"], lora.token_weights, 1), lora.weights["down_b"])

    return _when_active(lora, add, y)


__all__ = ["LoraBatch", "LoraLayer", "LoraLayers", "add_down", "add_gate_up", "add_o", "add_qkv", "token_weights"]
