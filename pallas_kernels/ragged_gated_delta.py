"""The one entry point of the gated delta rule over a paged step, :func:`ragged_gated_delta_rule`, and its
choice of backend.

A step is a ragged batch of sequences in the attention kernels' layout (``cu_q_lens``, ``num_seqs``); each
sequence continues the state in its own row ``seq_slots[s]`` of a pool ``[num_slots, H, Dk, Dv]`` float32, or
starts from zeros (``seq_fresh[s]``), and leaves its final state in that row. A step may mix prefill chunks,
continued chunks and decodes. The rule itself: :mod:`pallas_kernels.gated_delta`.

Backends: ``xla`` (:func:`xla_ragged_gated_delta`, a ``jnp`` scan over the tokens with the pool as its carry:
on CPU the fastest exact form, ``docs/benchmarks/gated_delta.md``), ``pallas-tpu`` (the Mosaic kernels of
:mod:`pallas_kernels.tpu.gated_delta`: the chunked form for sequences of two or more tokens, the recurrent form
for one-token sequences), ``pallas-gpu`` (the Triton kernel of :mod:`pallas_kernels.gpu.gated_delta`: the
recurrent form for every sequence) and ``pallas-tpu-interpret`` / ``pallas-gpu-interpret`` (those kernels in
interpret mode, on any platform). ``auto`` picks ``pallas-tpu`` on TPU, ``pallas-gpu`` on GPU, ``xla`` on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BACKENDS = ("auto", "xla", "pallas-tpu", "pallas-tpu-interpret", "pallas-gpu", "pallas-gpu-interpret")


def resolve_backend(backend: str, platform: str | None = None) -> str:
    """``auto`` -> ``pallas-tpu`` on TPU, ``pallas-gpu`` on GPU, else ``xla``; any other name of :data:`BACKENDS`
    as it is."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    return {"tpu": "pallas-tpu", "gpu": "pallas-gpu"}.get(platform or jax.default_backend(), "xla")


def _scan_step(q, k, v, g, beta, cu_q_lens, num_seqs, seq_slots, seq_fresh, pool) -> tuple[jax.Array, jax.Array]:
    """Token by token over the pool: each scan step reads its token's row, updates it and writes it back (an
    in-place ``dynamic_update_slice`` of the carry), so the only state traffic is those rows. Padding tokens
    touch row 0 with decay 1 and q = k = v = beta = 0: unchanged."""
    t = q.shape[0]
    f32 = jnp.float32
    max_seqs = seq_slots.shape[0]
    tok = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], tok, side="right"), 0, max_seqs - 1).astype(jnp.int32)
    valid = tok < cu_q_lens[num_seqs[0]]
    slot = jnp.where(valid, seq_slots[seq], 0).astype(jnp.int32)
    fresh = valid & (tok == cu_q_lens[seq]) & seq_fresh[seq]
    decay = jnp.where(valid[:, None], jnp.exp(g.astype(f32)), 1.0)  # [T, H]
    rows = lambda x: jnp.where(valid[:, None, None], x.astype(f32), 0.0)  # padding rows may hold anything
    q, k, v = rows(q), rows(k), rows(v)
    beta = jnp.where(valid[:, None], beta.astype(f32), 0.0)

    def step(p: jax.Array, x: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, d_t, b_t, s_t, f_t = x
        s = jax.lax.dynamic_index_in_dim(p, s_t, 0, keepdims=False)
        s = jnp.where(f_t, 0.0, s) * d_t[:, None, None]
        delta = (v_t - jnp.einsum("hkv,hk->hv", s, k_t)) * b_t[:, None]
        s = s + k_t[:, :, None] * delta[:, None, :]
        return jax.lax.dynamic_update_index_in_dim(p, s, s_t, 0), jnp.einsum("hkv,hk->hv", s, q_t)

    pool, out = jax.lax.scan(step, pool.astype(f32), (q, k, v, decay, beta, slot, fresh))
    return jnp.where(valid[:, None, None], out, 0.0), pool


@jax.jit
def xla_ragged_gated_delta(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    seq_slots: jax.Array,
    seq_fresh: jax.Array,
    pool: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The recurrent form over the pool (arguments: :func:`ragged_gated_delta_rule`) in ``jnp``, token by token
    (:func:`_scan_step`), for every step: on CPU it beat the chunked ``jnp`` form in prefill and a decode step
    that updates every row at once (gather, update, scatter) in decode (``docs/benchmarks/gated_delta.md``)."""
    return _scan_step(q, k, v, g, beta, cu_q_lens, num_seqs, seq_slots, seq_fresh, pool)


@functools.partial(jax.jit, static_argnames=("chunk_size", "backend"))
def ragged_gated_delta_rule(
    q: jax.Array,  # [T, H, Dk]: L2-normalised, scaled by Dk ** -0.5, heads repeated to the value heads
    k: jax.Array,  # [T, H, Dk]: L2-normalised
    v: jax.Array,  # [T, H, Dv]
    g: jax.Array,  # [T, H]: log decay, <= 0
    beta: jax.Array,  # [T, H]
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32: the step's sequences' token ranges
    num_seqs: jax.Array,  # [1] int32: real sequences (those past it have no tokens)
    seq_slots: jax.Array,  # [max_seqs] int32: each sequence's pool row
    seq_fresh: jax.Array,  # [max_seqs] bool: the sequence starts from zeros (its chunk starts at position 0)
    pool: jax.Array,  # [num_slots, H, Dk, Dv] float32
    *,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule of one paged step (module docstring). Returns ``(out [T, H, Dv] float32, pool)``:
    padding rows of ``out`` are zeros, and every real sequence's row of the pool holds its state after its last
    token. Rows of other slots are unchanged. The caller donates the pool so the update is in place."""
    concrete = resolve_backend(backend)
    args = (q, k, v, g, beta, cu_q_lens, num_seqs, seq_slots, seq_fresh, pool)
    if concrete == "xla":
        return xla_ragged_gated_delta(*args)
    if concrete.startswith("pallas-gpu"):
        from pallas_kernels.gpu.gated_delta import gated_delta_gpu

        return gated_delta_gpu(*args, interpret=concrete.endswith("interpret"))
    from pallas_kernels.tpu.gated_delta import gated_delta_tpu

    return gated_delta_tpu(*args, chunk_size=chunk_size, interpret=concrete.endswith("interpret"))


__all__ = ["BACKENDS", "ragged_gated_delta_rule", "resolve_backend", "xla_ragged_gated_delta"]
