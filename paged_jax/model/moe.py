"""The sparse mixture-of-experts MLP shared by Mixtral and Qwen3-MoE: top-k routing, grouped matmuls.

Each token's router probabilities (softmax in float32 over `num_experts`) pick its top `num_experts_per_tok`
experts; their weights are renormalised to sum to 1 when `norm_topk_prob` (Mixtral always, Qwen3-MoE by its
config). The T * k (token, expert) pairs are sorted by expert and the experts run as three grouped matmuls,
`jax.lax.ragged_dot` over the sorted rows with one group per expert (`group_sizes` [E]): no Python loop over
experts, and no expert sees a token it was not routed to. On TPU `ragged_dot` is XLA's grouped matmul; on CPU
XLA lowers it through a masked dense product (an XLA CPU detail, not the model's: the model's FLOPs are
T * k expert MLPs). Each pair's output is scaled by its router weight, put back in token order and summed
over the k experts in float32.

Parameters (kernels [in, out] per expert, as the dense MLP):
    router        [H, E]
    experts_gate  [E, H, I];  experts_up [E, H, I];  experts_down [E, I, H]

Parallelism: tensor parallel inside every expert (gate/up by columns of I, down by rows), the dense MLP's
layout (`paged_jax.model.partition`). Every chip holds a slice of every expert, so it runs the same routing
on the same (replicated) tokens with no all-to-all, its load does not depend on which experts are hot, and the
one all-reduce of [T, H] per layer is the one the dense MLP already pays. With a mesh the experts run under
`shard_map` and the partial sums are reduced as [T, H] once the k experts of each token are combined (the
compiled TP 4 step: one bf16[512, 2048] all-reduce per layer, like the attention output's):
left to GSPMD, the all-reduce landed on the down projection's [T * k, H] float32 rows (Qwen3-30B-A3B, 512
tokens: one f32[4096, 2048] all-reduce per layer, 2k = 16 times the bytes).
Expert parallelism would need a token all-to-all each layer and suffers from routing skew at small decode
batches; it pays off when experts outnumber what TP can split (I / tp too small for the MXU), which Mixtral
(I = 14336) and Qwen3-30B-A3B (I = 768, tp <= 8 gives 96 columns) do not reach on one host.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from paged_jax.config import ModelConfig
from paged_jax.model.layers import kernel_init

TP_AXIS = "tp"  # the mesh axis of paged_jax.worker.sharding


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Top-k routing. logits [T, E] -> (weights [T, k] float32, experts [T, k] int32), best expert first."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def grouped_experts(
    x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) with SwiGLU experts, by grouped matmuls.

    x [T, H]; weights [T, k] float32; experts [T, k] int32; w_gate, w_up [E, H, I]; w_down [E, I, H] (I may be
    one chip's slice: the result is then that chip's partial sum). Returns [T, H] float32.
    """
    t, k = experts.shape
    num_experts = w_gate.shape[0]
    flat = experts.reshape(-1)  # [T * k], pair p = (token p // k, its (p % k)-th expert)
    order = jnp.argsort(flat, stable=True)  # pairs sorted by expert
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]
    xs = x[order // k]  # [T * k, H]
    act = jax.nn.silu(jax.lax.ragged_dot(xs, w_gate, group_sizes)) * jax.lax.ragged_dot(xs, w_up, group_sizes)
    ys = jax.lax.ragged_dot(act, w_down, group_sizes, preferred_element_type=jnp.float32)  # [T * k, H]
    ys = ys * weights.reshape(-1)[order][:, None].astype(x.dtype).astype(jnp.float32)
    unsorted = jnp.zeros_like(ys).at[order].set(ys)  # back in pair order
    return unsorted.reshape(t, k, -1).sum(axis=1)


class SparseMoE(nn.Module):
    """Top-k routed SwiGLU experts (module docstring). x: [T, H] -> [T, H].

    `mesh`: with a "tp" axis of more than one device, the experts run per shard (`shard_map`) on that chip's
    slice of every expert, and the combined [T, H] partial sums are reduced with one `psum`.
    """

    config: ModelConfig
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        e, h, i = c.num_experts, c.hidden_size, c.intermediate_size
        router = self.param("router", kernel_init, (h, e), dtype)
        w_gate = self.param("experts_gate", kernel_init, (e, h, i), dtype)
        w_up = self.param("experts_up", kernel_init, (e, h, i), dtype)
        w_down = self.param("experts_down", kernel_init, (e, i, h), dtype)
        weights, experts = route(x @ router, c.num_experts_per_tok, c.norm_topk_prob)
        if self.mesh is None or self.mesh.size == 1:
            return grouped_experts(x, weights, experts, w_gate, w_up, w_down).astype(x.dtype)

        def shard(x, weights, experts, w_gate, w_up, w_down):
            return jax.lax.psum(grouped_experts(x, weights, experts, w_gate, w_up, w_down), TP_AXIS)

        column, row = P(None, None, TP_AXIS), P(None, TP_AXIS, None)
        out = jax.shard_map(
            shard, mesh=self.mesh, in_specs=(P(), P(), P(), column, column, row), out_specs=P(), check_vma=False
        )(x, weights, experts, w_gate, w_up, w_down)
        return out.astype(x.dtype)


__all__ = ["SparseMoE", "grouped_experts", "route"]
