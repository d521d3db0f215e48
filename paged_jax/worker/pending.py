"""The device side of the one-step lookahead (`paged_jax.engine.lookahead`): a token the host knows only as a
placeholder is taken from the in-flight step's samples, on the device, when the next step's inputs are built."""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.jit
def merge_pending(token_ids: jax.Array, prev_rows: jax.Array, prev_tokens: jax.Array) -> jax.Array:
    """token_ids [T] with the entries where prev_rows [T] >= 0 taken from prev_tokens [S_prev] on device."""
    taken = prev_tokens[jnp.clip(prev_rows, 0, prev_tokens.shape[0] - 1)]
    return jnp.where(prev_rows >= 0, taken, token_ids).astype(jnp.int32)


@jax.jit
def merge_pending_history(history: jax.Array, rows: jax.Array, cols: jax.Array, prev_tokens: jax.Array) -> jax.Array:
    """history [S, L] with entry (r, cols[r]) taken from prev_tokens [S_prev] at rows[r] where rows[r] >= 0: the
    lookahead's still-on-device token of a penalized sequence, for its penalties."""
    r = jnp.arange(history.shape[0])
    c = jnp.clip(cols, 0, history.shape[1] - 1)
    taken = prev_tokens[jnp.clip(rows, 0, prev_tokens.shape[0] - 1)]
    return history.at[r, c].set(jnp.where(rows >= 0, taken, history[r, c]))
