"""The device side of the recurrent-state pool of a linear-attention hybrid (Qwen3.5): one `LinearState` per linear
layer (`paged_jax.model.linear_state`), allocated zeroed with one row per state slot of the scheduler's slot
table (`paged_jax.kv_cache.state_pool`), what a slot costs in the memory budget, each step's `StateMeta`, and the
fork copies.

In the runner's per-layer cache tuple a full-attention layer's entry is its KV pages and a linear layer's is its
`LinearState`: the forward step donates and returns the whole tuple, so every state write is in place (a scatter
by slot), and the KV page copies (copy-on-write) pass the states through untouched.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.config import ModelConfig
from paged_jax.model.linear_state import LinearState, StateMeta, copy_slots
from paged_jax.sched.output import SchedulerOutput


def state_shapes(config: ModelConfig, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv [N, (K - 1) * C], recurrent [N, Hv, Dk, Dv]) of one linear layer's pool of `num_slots` rows."""
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim
    conv_dim += config.linear_num_value_heads * config.linear_value_head_dim
    conv = (num_slots, (config.linear_conv_kernel_dim - 1) * conv_dim)
    recurrent = (num_slots, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
    return conv, recurrent


def num_linear_layers(config: ModelConfig) -> int:
    return config.num_layers - config.num_kv_layers


def state_bytes_per_slot(config: ModelConfig) -> int:
    """Bytes of one state slot over every linear layer (float32 conv inputs and recurrent state)."""
    conv, recurrent = state_shapes(config, 1)
    return 4 * (int(np.prod(conv)) + int(np.prod(recurrent))) * num_linear_layers(config)


def state_pool_bytes(config: ModelConfig, max_num_seqs: int, num_snapshots: int = 0) -> int:
    """The whole pool: `max_num_seqs` slots, the null slot and `num_snapshots` rows after them (prefix-cache
    snapshots, speculation checkpoints) (0 for a model without linear layers)."""
    return state_bytes_per_slot(config) * (max_num_seqs + 1 + num_snapshots) if num_linear_layers(config) else 0


def allocate_state(config: ModelConfig, num_slots: int, device=None) -> LinearState:
    conv, recurrent = state_shapes(config, num_slots)
    return LinearState(jnp.zeros(conv, jnp.float32, device=device), jnp.zeros(recurrent, jnp.float32, device=device))


def abstract_state(config: ModelConfig, num_slots: int, sharding) -> LinearState:
    conv, recurrent = state_shapes(config, num_slots)
    return LinearState(
        jax.ShapeDtypeStruct(conv, jnp.float32, sharding=sharding),  # type: ignore[arg-type]  # abstract leaves
        jax.ShapeDtypeStruct(recurrent, jnp.float32, sharding=sharding),  # type: ignore[arg-type]
    )


def linear_backend(attention_backend: str) -> str:
    """The kernels a step's linear layers use (`pallas_kernels.ragged_gated_delta.BACKENDS`), from the attention
    backend the runner resolved for its platform: the Pallas kernels beside the Pallas attention kernels (compiled
    or interpreted), XLA otherwise (CPU). Said by the runner rather than picked from this process's default
    platform, so that a step compiled for another target (`paged_jax.engine.aot`) is the step that target runs."""
    kernels = ("pallas-tpu", "pallas-tpu-interpret", "pallas-gpu", "pallas-gpu-interpret")
    return attention_backend if attention_backend in kernels else "xla"


def build_state_meta(sched: SchedulerOutput, t: int, s: int, backend: str) -> StateMeta:
    """The step's `StateMeta` (host numpy arrays) for token bucket `t` and sequence bucket `s`; `backend`: the
    linear layers' kernels (`linear_backend`)."""
    token_seq = np.full(t, -1, np.int32)
    slots = np.zeros(s, np.int32)
    fresh = np.ones(s, bool)
    if sched.state_slots is None or len(sched.state_slots) != len(sched.scheduled):
        raise ValueError("state_slots: a linear-attention step needs one state slot per scheduled sequence")
    off = 0
    for i, item in enumerate(sched.scheduled):
        n = item.num_scheduled
        token_seq[off : off + n] = i
        off += n
        fresh[i] = item.start == 0
    slots[: len(sched.scheduled)] = sched.state_slots
    return StateMeta(token_seq, slots, fresh, backend)  # type: ignore[arg-type]  # host numpy arrays: the jitted step's inputs


def state_meta_specs(t: int, s: int, spec, backend: str) -> StateMeta:
    """`StateMeta`'s abstract leaves for lowering (`spec(*shape, dtype=...)`), with the same `backend` as the
    step's `build_state_meta` (it is part of the step's tree)."""
    return StateMeta(spec(t), spec(s), spec(s, dtype=jnp.bool_), backend)


def _copy_states(kv_caches, src, dst, backend: str):
    return tuple(copy_slots(c, src, dst, backend) if isinstance(c, LinearState) else c for c in kv_caches)


@functools.cache
def copy_states_function(backend: str):
    """The fork copies on every linear layer of the runner's cache tuple, jitted with the tuple donated (the KV
    pages pass through in place); `backend`: the linear layers' kernels (`linear_backend`)."""
    return jax.jit(functools.partial(_copy_states, backend=backend), donate_argnums=(0,))


__all__ = [
    "abstract_state",
    "allocate_state",
    "build_state_meta",
    "copy_states_function",
    "linear_backend",
    "num_linear_layers",
    "state_bytes_per_slot",
    "state_meta_specs",
    "state_pool_bytes",
    "state_shapes",
]
