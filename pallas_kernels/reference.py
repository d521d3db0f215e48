"""Pure-``jnp`` dense reference for ragged causal attention over contiguous per-sequence K/V.

It is deliberately naive (every token gathers its whole sequence's keys, float32 at highest precision) so that
it is obviously right; the tests compare every backend against it. Conventions are those of :mod:`.common`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import MASK_VALUE, apply_soft_cap, visible


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window"))
def dense_reference_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    k: jax.Array,  # [max_seqs, max_kv_len, num_kv_heads, head_dim], contiguous per sequence
    v: jax.Array,  # [max_seqs, max_kv_len, num_kv_heads, head_dim]
    kv_lens: jax.Array,  # [max_seqs] int32
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Ragged causal attention on dense K/V; returns ``[num_tokens, num_q_heads, head_dim]`` in ``q.dtype``.

    Sequence ``s`` owns query tokens ``cu_q_lens[s]:cu_q_lens[s+1]`` and keys ``k[s, :kv_lens[s]]``. Rows of
    padding tokens (past ``cu_q_lens[num_seqs[0]]``) are zeros.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    max_seqs, max_kv_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right").astype(jnp.int32) - 1, 0, max_seqs - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    kv_len = kv_lens[seq]
    real = (tok < cu_q_lens[num_seqs[0]]) & (tok >= cu_q_lens[seq]) & (tok - cu_q_lens[seq] < q_len)
    q_pos = kv_len - q_len + (tok - cu_q_lens[seq])  # [T]
    k_pos = jnp.arange(max_kv_len, dtype=jnp.int32)  # [L]
    mask = visible(q_pos[:, None], k_pos[None, :], sliding_window) & (k_pos[None, :] < kv_len[:, None])
    mask = mask & real[:, None]  # [T, L]

    kt = jnp.repeat(k[seq].astype(jnp.float32), group, axis=2)  # [T, L, H, D]
    vt = jnp.repeat(v[seq].astype(jnp.float32), group, axis=2)
    kt = jnp.where(mask[:, :, None, None], kt, 0.0)  # stale slots may hold anything, NaN included
    vt = jnp.where(mask[:, :, None, None], vt, 0.0)
    qf = jnp.where(real[:, None, None], q.astype(jnp.float32), 0.0)
    logits = jnp.einsum("thd,tlhd->thl", qf, kt, precision=jax.lax.Precision.HIGHEST) * sm_scale
    logits = apply_soft_cap(logits, soft_cap)
    logits = jnp.where(mask[:, None, :], logits, MASK_VALUE)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.where(mask[:, None, :], jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("thl,tlhd->thd", p, vt, precision=jax.lax.Precision.HIGHEST)
    out = jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)
    del head_dim
    return out.astype(q.dtype)
