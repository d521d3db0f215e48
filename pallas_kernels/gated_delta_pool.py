"""The gated delta rule over a paged engine's step: a flat batch of sequences, each continuing the state held in
its own row of a state pool, the pool updated in place.

The same rule as `pallas_kernels.gated_delta` (that module's docstring), token by token, but where that form
starts every segment past the first from zeros, here every token names its sequence's pool row (``slots``):

    S <- pool[slot_t]                      (zeros instead, for the first token of a sequence starting at 0)
    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
    pool[slot_t] <- S

so a step may mix prefill chunks that continue earlier chunks, fresh prompts and decodes, and leaves each
sequence's state in its row for the next step. The pool is the scan's carry: the only state traffic is the
row each token reads and writes (no gather of the step's states, no copy of the pool; the caller donates it).
Padding tokens name the null row 0 and leave it as it was (decay 1, k = 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.jit
def pooled_gated_delta_rule(
    q: jax.Array,  # [T, H, Dk], L2-normalised and scaled
    k: jax.Array,  # [T, H, Dk], L2-normalised
    v: jax.Array,  # [T, H, Dv]
    g: jax.Array,  # [T, H]: log decay, <= 0
    beta: jax.Array,  # [T, H]
    slots: jax.Array,  # [T] int32: the token's pool row (0 for padding)
    fresh: jax.Array,  # [T] bool: the token starts its sequence (position 0): zeros, not the row
    valid: jax.Array,  # [T] bool: a real token (False: padding)
    pool: jax.Array,  # [N, H, Dk, Dv] float32
) -> tuple[jax.Array, jax.Array]:
    """Returns (out [T, H, Dv] float32, the updated pool [N, H, Dk, Dv] float32)."""
    f32 = jnp.float32
    decay = jnp.where(valid[:, None], jnp.exp(g.astype(f32)), 1.0)  # [T, H]
    k = jnp.where(valid[:, None, None], k.astype(f32), 0.0)

    def step(p: jax.Array, x: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, d_t, b_t, slot, start = x
        s = jax.lax.dynamic_index_in_dim(p, slot, 0, keepdims=False)
        s = jnp.where(start, 0.0, s) * d_t[:, None, None]
        delta = (v_t - jnp.einsum("hkv,hk->hv", s, k_t)) * b_t[:, None]
        s = s + k_t[:, :, None] * delta[:, None, :]
        p = jax.lax.dynamic_update_index_in_dim(p, s, slot, 0)
        return p, jnp.einsum("hkv,hk->hv", s, q_t)

    xs = (q.astype(f32), k, v.astype(f32), decay, beta.astype(f32), slots.astype(jnp.int32), fresh)
    pool, out = jax.lax.scan(step, pool.astype(f32), xs)
    return out, pool


__all__ = ["pooled_gated_delta_rule"]
