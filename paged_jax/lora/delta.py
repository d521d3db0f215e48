"""How is a batch's LoRA delta computed? For every token at once, whatever mix of adapters the batch holds.

Each token t carries a slot id; `token_weights` turns the ids into `w [T, S]`: the slot's scaling in the
token's own slot column and 0 elsewhere (slot 0, "no adapter", has scaling 0). A projection's delta is then
two matmuls over all slots together (the one-hot formulation of BGMV that tpu-inference uses):

    shrink   u[t, s, :] = (x[t] @ A[s]) * w[t, s]            x [T, in] @ A [in, S * R] -> [T, S, R]
    expand   delta[t]   = sum_s u[t, s, :] @ B[s]            [T, S * R] @ B [S * R, out] -> [T, out]

so a token only ever receives its own adapter's `scaling * B(A(x))` (PEFT's formula) and the executable's
shapes depend on (T, S, R) alone: changing which adapters run never recompiles. The other formulation, a
gather of every token's own A and B (`A[slots] [T, in, R]`), reads T copies of the weights instead of S;
`scripts/bench_lora.py` measures both and the README gives the figures and the reason for this choice.

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
    """One layer's adapter arrays (`paged_jax.lora.weights`) and the step's token weights `w` [T, S] float32."""

    weights: Layer
    token_weights: jax.Array

    @property
    def has_mlp(self) -> bool:
        return "gate_up_a" in self.weights


@flax.struct.dataclass
class LoraBatch:
    """A step's LoRA input: every slot's arrays and each token's slot id `slots` [T] int32 (0: no adapter)."""

    weights: LoraWeights
    slots: jax.Array

    def per_layer(self) -> list[LoraLayer]:
        """Each layer's `LoraLayer`, sharing one `token_weights` computed once for the step."""
        w = token_weights(self.slots, self.weights.scaling)
        return [LoraLayer(layer, w) for layer in self.weights.layers]


def token_weights(slots: jax.Array, scaling: jax.Array) -> jax.Array:
    """w [T, S] float32: `scaling[slots[t]]` at column `slots[t]`, 0 elsewhere. slots [T] int32, scaling [S]."""
    hit = slots[:, None] == jnp.arange(scaling.shape[0], dtype=slots.dtype)[None, :]
    return jnp.where(hit, scaling[None, :], 0.0).astype(F32)


def _shrink(x: jax.Array, a: jax.Array, w: jax.Array, contract: int) -> jax.Array:
    """x [T, *in] contracted with a [*in, *k, S, R] over `contract` axes, times w [T, S]: [T, *k, S, R] in x.dtype."""
    dims = ((tuple(range(1, 1 + contract)), tuple(range(contract))), ((), ()))
    u = jax.lax.dot_general(x, a, dims, preferred_element_type=F32)  # [T, *k, S, R]
    w = w.reshape(w.shape[0], *([1] * (u.ndim - 3)), w.shape[1], 1)
    return (u * w).astype(x.dtype)


def _expand(u: jax.Array, b: jax.Array) -> jax.Array:
    """u [T, S, R] with b [S, R, *out] -> [T, *out] (S and R contracted together) in u.dtype."""
    dims = (((1, 2), (0, 1)), ((), ()))
    return jax.lax.dot_general(u, b, dims, preferred_element_type=F32).astype(u.dtype)


def qkv_delta(x: jax.Array, lora: LoraLayer) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The deltas of q [T, Hq, D], k and v [T, Hkv, D] for x [T, H]: one shrink for all three."""
    lw = lora.weights
    u = _shrink(x, lw["qkv_a"], lora.token_weights, 1)  # [T, 3, S, R]
    return _expand(u[:, 0], lw["q_b"]), _expand(u[:, 1], lw["k_b"]), _expand(u[:, 2], lw["v_b"])


def o_delta(out: jax.Array, lora: LoraLayer) -> jax.Array:
    """The delta of o_proj [T, H] for the attention output [T, Hq, D]."""
    return _expand(_shrink(out, lora.weights["o_a"], lora.token_weights, 2), lora.weights["o_b"])


def gate_up_delta(x: jax.Array, lora: LoraLayer) -> tuple[jax.Array, jax.Array]:
    """The deltas of gate and up [T, I] for x [T, H]: one shrink for both."""
    lw = lora.weights
    u = _shrink(x, lw["gate_up_a"], lora.token_weights, 1)  # [T, 2, S, R]
    return _expand(u[:, 0], lw["gate_b"]), _expand(u[:, 1], lw["up_b"])


def down_delta(h: jax.Array, lora: LoraLayer) -> jax.Array:
    """The delta of down_proj [T, H] for its input h [T, I]."""
    return _expand(_shrink(h, lora.weights["down_a"], lora.token_weights, 1), lora.weights["down_b"])


__all__ = ["LoraBatch", "LoraLayer", "down_delta", "gate_up_delta", "o_delta", "qkv_delta", "token_weights"]
