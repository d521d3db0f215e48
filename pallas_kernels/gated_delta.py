"""Pure-``jnp`` reference of the gated delta rule (Gated DeltaNet, Qwen3.5's linear attention), two exact forms.

Per value head, with the state ``S`` [Dk, Dv] (float32), a decay ``g`` (log space, <= 0) and a rate ``beta``
per token, token t does

    S <- S * exp(g_t)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T        (the delta rule: write only what S does not yet predict)
    o_t = S^T q_t

- ``recurrent_gated_delta_rule``: that loop, one token per scan step (decode: one token per sequence).
- ``chunked_gated_delta_rule``: the same function in chunks of ``chunk_size`` tokens (64, as transformers and
  flash-linear-attention use): inside a chunk the updates are condensed by the UT transform into a few matmuls
  (one triangular solve), and the state is carried from chunk to chunk (prefill on TPU and GPU; on CPU the model
  runs the recurrent form for prefill too: `paged_jax.model.gated_deltanet.delta_rule_form`).

Both run over a flat batch of several sequences, as the attention kernels do: ``segment_ids`` [T] names each
token's sequence (contiguous runs; -1 marks padding, which never touches a state), and a token reads only the
state and the tokens of its own segment. The chunked form masks every pairwise term between segments, so chunk
boundaries need not align with sequence starts: its chunks of the flat batch compute each sequence's own rule.
``initial_state`` is the state of the first segment (a sequence continued from an earlier step); every later
segment starts from zeros. Both return the final state of the last segment.

Inputs are taken as they come out of the layer: q and k already L2-normalised, q already scaled by Dk ** -0.5,
k/q heads already repeated to the value heads; everything runs in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@jax.jit
def recurrent_gated_delta_rule(
    q: jax.Array,  # [T, H, Dk]
    k: jax.Array,  # [T, H, Dk]
    v: jax.Array,  # [T, H, Dv]
    g: jax.Array,  # [T, H]: log decay, <= 0
    beta: jax.Array,  # [T, H]
    segment_ids: jax.Array,  # [T] int32, -1 = padding
    initial_state: jax.Array | None = None,  # [H, Dk, Dv] float32: the first segment's state
) -> tuple[jax.Array, jax.Array]:
    """The token-by-token form. Returns (out [T, H, Dv] float32, final state [H, Dk, Dv] float32)."""
    t, h, dk = k.shape
    dv = v.shape[-1]
    f32 = jnp.float32
    state = jnp.zeros((h, dk, dv), f32) if initial_state is None else initial_state.astype(f32)
    prev = jnp.concatenate([segment_ids[:1], segment_ids[:-1]])
    valid = (segment_ids >= 0)[:, None]  # [T, 1]
    # The segment logic folds into the per-head scalars, so a step touches the state only in the rule itself:
    # a token that starts a sequence decays the old state by 0 (it starts from zeros), and padding decays by 1
    # and writes with k = 0, which leaves the state exactly as it was.
    decay = jnp.where(valid, jnp.where((segment_ids != prev)[:, None], 0.0, jnp.exp(g.astype(f32))), 1.0)  # [T, H]
    k = jnp.where(valid[:, :, None], k.astype(f32), 0.0)

    def step(s: jax.Array, x: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, d_t, b_t = x
        s = s * d_t[:, None, None]
        delta = (v_t - jnp.einsum("hkv,hk->hv", s, k_t)) * b_t[:, None]
        s = s + k_t[:, :, None] * delta[:, None, :]
        return s, jnp.einsum("hkv,hk->hv", s, q_t)

    xs = (q.astype(f32), k, v.astype(f32), decay, beta.astype(f32))
    state, out = jax.lax.scan(step, state, xs)
    return out, state


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def chunked_gated_delta_rule(
    q: jax.Array,  # [T, H, Dk]
    k: jax.Array,  # [T, H, Dk]
    v: jax.Array,  # [T, H, Dv]
    g: jax.Array,  # [T, H]
    beta: jax.Array,  # [T, H]
    segment_ids: jax.Array,  # [T] int32, -1 = padding
    initial_state: jax.Array | None = None,  # [H, Dk, Dv] float32
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """The chunked form (module docstring); the same results as `recurrent_gated_delta_rule` up to float32
    rounding. Returns (out [T, H, Dv] float32, final state [H, Dk, Dv] float32)."""
    t, h, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    f32 = jnp.float32
    pad = (-t) % c
    n = (t + pad) // c
    valid = segment_ids >= 0

    def chunks(x: jax.Array, fill: float = 0.0) -> jax.Array:  # [T, ...] -> [n, c, ...]
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        return x.reshape(n, c, *x.shape[1:])

    gate = jnp.where(valid[:, None], g.astype(f32), 0.0)
    rate = jnp.where(valid[:, None], beta.astype(f32), 0.0)
    qc, kc, vc = chunks(q.astype(f32)), chunks(k.astype(f32)), chunks(v.astype(f32))
    gc, bc, sc = chunks(gate), chunks(rate), chunks(segment_ids.astype(jnp.int32), -1)
    state = jnp.zeros((h, dk, dv), f32) if initial_state is None else initial_state.astype(f32)
    lower = jnp.tril(jnp.ones((c, c), bool))  # j <= i
    strict = jnp.tril(jnp.ones((c, c), bool), -1)  # j < i

    Carry = tuple[jax.Array, jax.Array]

    def step(carry: Carry, x: tuple[jax.Array, ...]) -> tuple[Carry, jax.Array]:
        s, carried = carry  # the state and the segment it belongs to
        q_c, k_c, v_c, g_c, b_c, seg = x  # [c, H, Dk], [c, H, Dk], [c, H, Dv], [c, H], [c, H], [c]
        same = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)  # [c, c]
        cont = (seg == carried) & (seg >= 0)  # [c]: tokens that continue the carried state (a prefix)
        cum = jnp.cumsum(g_c, axis=0).T  # [H, c]: log decay from the chunk's start through token i
        diff = cum[:, :, None] - cum[:, None, :]  # [H, c, c]: from token j to token i
        decay = jnp.where(lower & same, jnp.exp(jnp.where(lower & same, diff, 0.0)), 0.0)
        qh, kh, vh = q_c.transpose(1, 0, 2), k_c.transpose(1, 0, 2), v_c.transpose(1, 0, 2)  # [H, c, D]
        k_beta = kh * b_c.T[:, :, None]
        v_beta = vh * b_c.T[:, :, None]
        system = jnp.where(strict, jnp.einsum("hik,hjk->hij", k_beta, kh) * decay, 0.0)  # [H, c, c]
        unit = system + jnp.eye(c, dtype=f32)
        from_state = jnp.where(cont[None, :, None], k_beta * jnp.exp(cum)[:, :, None], 0.0)
        solve = functools.partial(jax.lax.linalg.triangular_solve, left_side=True, lower=True, unit_diagonal=True)
        new_values = solve(unit, v_beta)  # [H, c, Dv]
        k_cumdecay = solve(unit, from_state)  # [H, c, Dk]
        v_new = new_values - jnp.einsum("hik,hkv->hiv", k_cumdecay, s)
        read = jnp.where(cont[None, :, None], qh * jnp.exp(cum)[:, :, None], 0.0)
        attn = jnp.einsum("hik,hjk->hij", qh, kh) * decay
        out = jnp.einsum("hik,hkv->hiv", read, s) + jnp.einsum("hij,hjv->hiv", attn, v_new)
        real = seg >= 0
        last = jnp.where(real.any(), seg[c - 1 - jnp.argmax(real[::-1])], -1)  # the last real token's segment
        mine = (seg == last) & real  # tokens of the segment whose state leaves this chunk
        # padding has g = 0, so cum[:, -1] is the decay through the last real token
        tail = jnp.where(mine[None, :], jnp.exp(cum[:, -1:] - jnp.where(mine[None, :], cum, 0.0)), 0.0)  # [H, c]
        base = jnp.where(last == carried, s * jnp.exp(cum[:, -1])[:, None, None], 0.0)
        s_next = base + jnp.einsum("hjk,hjv->hkv", kh * tail[:, :, None], v_new)
        keep = last < 0  # a chunk of padding alone leaves the state as it was
        s_next = jnp.where(keep, s, s_next)
        return (s_next, jnp.where(keep, carried, last)), out.transpose(1, 0, 2)

    first = segment_ids[0].astype(jnp.int32)
    (state, _), out = jax.lax.scan(step, (state, first), (qc, kc, vc, gc, bc, sc))
    return out.reshape(n * c, h, dv)[:t], state


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis, in float32 (flash-linear-attention's and transformers')."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


__all__ = ["chunked_gated_delta_rule", "l2_normalize", "recurrent_gated_delta_rule"]
