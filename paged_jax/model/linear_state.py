"""A linear-attention layer's state in the paged engine: its rows of the state pool, and the step's metadata that
says which row each sequence reads and writes.

Per linear layer the runner holds one `LinearState` (`paged_jax.worker.linear_state` allocates it): row r is
state slot r (`paged_jax.kv_cache.state_pool`; row 0 the null slot), in float32:
- ``conv`` [N, (K - 1) * C]: the last K - 1 inputs of the depthwise causal conv (``x @ in_proj_qkv``, oldest
  first, each C wide; zeros before a sequence's first token), one flat row per slot (a 2-D array keeps TPU's
  default layout, which the row kernels read in place);
- ``recurrent`` [N, Hv, Dk, Dv]: the gated delta rule's state.

A step's `StateMeta` names each token's sequence and each sequence's slot; a sequence whose chunk starts at
position 0 (``seq_fresh``) starts from zero states whatever its slot holds. The layer reads the rows, runs the
rule over the step's mixed prefill chunks and decodes, and writes each sequence's rows back in place (the
arrays are donated with the KV pages). On TPU the conv rows move through `pallas_kernels.tpu.state_rows`, the
recurrent rows through the gated delta kernels, so neither array leaves HBM.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from pallas_kernels.ragged_gated_delta import ragged_gated_delta_rule, resolve_backend
from pallas_kernels.tpu.state_rows import read_rows_tpu, write_rows_tpu


@flax.struct.dataclass
class LinearState:
    """One linear layer's state pool (module docstring)."""

    conv: jax.Array  # [N, (K - 1) * C] f32
    recurrent: jax.Array  # [N, Hv, Dk, Dv] f32


@flax.struct.dataclass
class StateMeta:
    """Which state rows a step's tokens read and write."""

    token_seq: jax.Array  # [T] i32: the token's sequence (index into the step's sequences); -1 for padding
    seq_slots: jax.Array  # [S] i32: each sequence's state slot (0, the null slot, for padding sequences)
    seq_fresh: jax.Array  # [S] bool: the sequence's chunk starts at position 0 (zero states); True for padding
    # the kernels the rows go through (`pallas_kernels.ragged_gated_delta.BACKENDS`): the step's platform's, chosen
    # by the runner (a compile for another target than this process's platform needs it said, not guessed)
    backend: str = flax.struct.field(pytree_node=False, default="auto")


def paged_conv(
    x: jax.Array, weight: jax.Array, conv: jax.Array, meta: StateMeta, cu_q_lens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The depthwise causal conv + SiLU over a step's flat batch, each sequence continuing the inputs in its conv
    row. x [T, C] (model dtype); weight [K, C]; conv [N, (K - 1) * C] f32; cu_q_lens [S + 1].
    Returns (out [T, C], the updated conv rows [N, (K - 1) * C]).

    The arithmetic is `paged_jax.model.gated_deltanet.causal_conv1d`'s, tap by tap: a tap before the step's
    chunk reads the row (zeros for a fresh sequence), one inside it reads the step's own input."""
    t, c = x.shape
    w_n = weight.shape[0] - 1  # K - 1
    s = meta.seq_slots.shape[0]
    valid = meta.token_seq >= 0
    seq = jnp.maximum(meta.token_seq, 0)
    offset = jnp.arange(t, dtype=jnp.int32) - cu_q_lens[seq]  # the token's index inside its chunk
    old = _read_rows(conv, meta).reshape(s, w_n, c)
    old = jnp.where(meta.seq_fresh[:, None, None], 0.0, old).astype(x.dtype)  # [S, K - 1, C]
    ext = jnp.concatenate([old.reshape(s * w_n, c), x])  # rows: every sequence's old inputs, then the step's
    flat = jnp.arange(t, dtype=jnp.int32)
    out = x * weight[w_n]
    for w in range(1, w_n + 1):
        src = jnp.where(offset >= w, s * w_n + flat - w, seq * w_n + w_n + offset - w)
        out = out + jnp.where(valid[:, None], ext[src], 0) * weight[w_n - w]
    n = cu_q_lens[1:] - cu_q_lens[:-1]  # [S] tokens per sequence this step
    m = n[:, None] + jnp.arange(w_n, dtype=jnp.int32)[None, :]  # [S, K - 1]: row k of the new inputs in [old | new]
    rows = jnp.arange(s, dtype=jnp.int32)[:, None]
    src = jnp.where(m < w_n, rows * w_n + m, s * w_n + cu_q_lens[:-1, None] + m - w_n)
    conv = _write_rows(conv, meta, ext[src].reshape(s, w_n * c).astype(conv.dtype))
    return jax.nn.silu(out), conv


def _tpu_rows(backend: str) -> bool | None:
    """Whether conv rows move through the TPU row kernels (`pallas_kernels.tpu.state_rows`: XLA:TPU
    would stage the small conv pool in VMEM whole for a gather and a scatter): False for the compiled kernels,
    True in interpret mode, None for XLA's gather and scatter."""
    return {"pallas-tpu": False, "pallas-tpu-interpret": True}.get(resolve_backend(backend))


def _read_rows(conv: jax.Array, meta: StateMeta) -> jax.Array:
    interpret = _tpu_rows(meta.backend)
    return conv[meta.seq_slots] if interpret is None else read_rows_tpu(conv, meta.seq_slots, interpret)


def _write_rows(conv: jax.Array, meta: StateMeta, rows: jax.Array) -> jax.Array:
    interpret = _tpu_rows(meta.backend)
    if interpret is None:
        return conv.at[meta.seq_slots].set(rows)
    return write_rows_tpu(conv, meta.seq_slots, rows, interpret)


def paged_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    recurrent: jax.Array,
    meta: StateMeta,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over the step (`pallas_kernels.ragged_gated_delta`: the Pallas kernels on TPU and GPU,
    a token scan on CPU), each sequence continuing its recurrent row. q, k [T, Hv, Dk], v [T, Hv, Dv],
    g, beta [T, Hv]; recurrent [N, Hv, Dk, Dv] f32; cu_q_lens [S + 1], num_seqs [1] i32.
    Returns (out [T, Hv, Dv] f32, the updated rows)."""
    return ragged_gated_delta_rule(
        q, k, v, g, beta, cu_q_lens, num_seqs, meta.seq_slots, meta.seq_fresh, recurrent, backend=meta.backend
    )


def copy_slots(state: LinearState, src: jax.Array, dst: jax.Array, backend: str = "auto") -> LinearState:
    """Rows `src` copied onto rows `dst` ([n] i32 each; padding copies the null row onto itself); `backend` as
    `StateMeta.backend` (the conv rows through the TPU row kernels on TPU)."""
    interpret = _tpu_rows(backend)
    if interpret is None:
        conv = state.conv.at[dst].set(state.conv[src])
    else:
        conv = write_rows_tpu(state.conv, dst, read_rows_tpu(state.conv, src, interpret), interpret)
    return LinearState(conv, state.recurrent.at[dst].set(state.recurrent[src]))


__all__ = ["LinearState", "StateMeta", "copy_slots", "paged_conv", "paged_delta_rule"]
