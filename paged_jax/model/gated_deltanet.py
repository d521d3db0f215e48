"""The Gated DeltaNet token mixer of Qwen3.5's linear-attention layers, over a flat batch of sequences.

Per token x [H]:
    qkv = x @ in_proj_qkv  ->  depthwise causal conv1d of width K over each sequence's tokens, then SiLU
    q, k, v = split(qkv) into [Hk, Dk], [Hk, Dk], [Hv, Dv];  q and k L2-normalised, q * Dk ** -0.5, both
    repeated to the Hv value heads (each q/k head serves Hv / Hk consecutive value heads)
    beta = sigmoid(x @ in_proj_b) [Hv];  g = -exp(A_log) * softplus(x @ in_proj_a + dt_bias) [Hv]  (log decay)
    o = gated delta rule (`pallas_kernels.gated_delta`, state [Hv, Dk, Dv] float32)
    out = (RMSNorm(o) * weight * silu(x @ in_proj_z)) @ out_proj      (the gated RMSNorm, per value head)

Parameters (`linear_attn/`, kernels [in, out]): in_proj_qkv [H, 2 Hk Dk + Hv Dv], in_proj_z [H, Hv Dv],
in_proj_b [H, Hv], in_proj_a [H, Hv], conv1d [K, 2 Hk Dk + Hv Dv] (tap K - 1 reads the token itself),
A_log [Hv], dt_bias [Hv], norm/weight [Dv], out_proj [Hv Dv, H].

Two paths, by the metadata the layer gets:
- dense (`DenseMeta`, no state): every sequence from its first token, states from zero, as the reference and the
  HF-parity tests run it, with the rule in the platform's form (below);
- paged (metadata with a `StateMeta` in `state`, and the layer's `LinearState`): each sequence of the step
  continues the conv inputs and the rule's state in its slot of the state pool, and leaves them there
  (`paged_jax.model.linear_state`); the rule runs through `pallas_kernels.ragged_gated_delta` (Pallas on TPU/GPU).

The rule has two exact forms (the same function up to float32 rounding), and `delta_rule_form` picks one by the
platform the layer is traced for:
- "chunked" on TPU and GPU: chunks of `CHUNK_SIZE` tokens become a few [C, C] and [C, D] matmuls and one
  triangular solve per chunk, which the matrix units run well; the scan is over T / C chunks.
- "recurrent" on CPU: one token per scan step, a [Hv, Dk, Dv] state update of O(Dk Dv) work per head and token.
  XLA:CPU has no matrix unit to feed, so the chunked form's extra work (the [C, C] system, the solve, the
  per-chunk masks) costs more than the parallelism it buys there (docs/benchmarks/gated_delta.md).
"""

from __future__ import annotations

from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from paged_jax.config import ModelConfig
from paged_jax.model.attention import DenseMeta
from paged_jax.model.layers import kernel_init
from paged_jax.model.linear_state import LinearState, StateMeta, paged_conv, paged_delta_rule
from pallas_kernels.gated_delta import chunked_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule

CHUNK_SIZE = 64  # the chunked rule's chunk, as transformers and flash-linear-attention use

DeltaRuleForm = Literal["chunked", "recurrent"]


def delta_rule_form(platform: str) -> DeltaRuleForm:
    """The form of the gated delta rule the layers run on `platform` (a JAX platform name: "cpu", "tpu", "gpu",
    ...): "recurrent" on CPU, "chunked" elsewhere (module docstring)."""
    return "recurrent" if platform == "cpu" else "chunked"


def gated_delta_rule(
    form: DeltaRuleForm, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, seg: jax.Array
) -> jax.Array:
    """The rule in `form` over a flat batch from zero states: q, k [T, Hv, Dk], v [T, Hv, Dv], g, beta [T, Hv],
    seg [T] -> out [T, Hv, Dv] float32."""
    if form == "chunked":
        out, _ = chunked_gated_delta_rule(q, k, v, g, beta, seg, chunk_size=CHUNK_SIZE)
    elif form == "recurrent":
        out, _ = recurrent_gated_delta_rule(q, k, v, g, beta, seg)
    else:
        raise ValueError(f"form: {form!r} is not a gated delta rule form (chunked, recurrent)")
    return out


def causal_conv1d(x: jax.Array, weight: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Depthwise causal conv over each segment's tokens, zero before a segment's first token, then SiLU.
    x [T, C]; weight [K, C] (tap K - 1 is the token itself, tap K - 1 - w the token w back); segment_ids [T]."""
    width = weight.shape[0]
    out = x * weight[width - 1]
    for w in range(1, width):
        back = jnp.pad(x, ((w, 0), (0, 0)))[: x.shape[0]]
        same = jnp.pad(segment_ids, (w, 0), constant_values=-1)[: x.shape[0]] == segment_ids
        out = out + jnp.where(same[:, None], back, 0) * weight[width - 1 - w]
    return jax.nn.silu(out)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention mixer (module docstring). x [T, H] -> [T, H]."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, meta: Any, state: LinearState | None = None) -> tuple[jax.Array, Any]:
        """x [T, H] -> ([T, H], the updated `state`: None on the dense path)."""
        paged: StateMeta | None = getattr(meta, "state", None)
        if (paged is None) != (state is None) or (paged is None and not isinstance(meta, DenseMeta)):
            raise TypeError(
                f"GatedDeltaNet: dense metadata without a state, or metadata with a StateMeta and the layer's "
                f"LinearState; got {type(meta).__name__} and {type(state).__name__}"
            )
        c = self.config
        dtype = jnp.dtype(c.dtype)
        h, hk, hv = c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        conv_dim = 2 * hk * dk + hv * dv
        in_qkv = self.param("in_proj_qkv", kernel_init, (h, conv_dim), dtype)
        in_z = self.param("in_proj_z", kernel_init, (h, hv * dv), dtype)
        in_b = self.param("in_proj_b", kernel_init, (h, hv), dtype)
        in_a = self.param("in_proj_a", kernel_init, (h, hv), dtype)
        conv = self.param("conv1d", kernel_init, (c.linear_conv_kernel_dim, conv_dim), dtype)
        a_log = self.param("A_log", nn.initializers.zeros, (hv,), dtype)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (hv,), dtype)
        norm_weight = self.param("norm_weight", nn.initializers.ones, (dv,), dtype)
        out_proj = self.param("out_proj", kernel_init, (hv * dv, h), dtype)

        t = x.shape[0]
        if state is None:
            seg = meta.segment_ids
            mixed = causal_conv1d(x @ in_qkv, conv, seg)  # [T, C]
        else:
            assert paged is not None  # checked above
            mixed, conv_rows = paged_conv(x @ in_qkv, conv, state.conv, paged, meta.cu_q_lens)
        q = mixed[:, : hk * dk].reshape(t, hk, dk)
        k = mixed[:, hk * dk : 2 * hk * dk].reshape(t, hk, dk)
        v = mixed[:, 2 * hk * dk :].reshape(t, hv, dv)
        q = jnp.repeat(l2_normalize(q) * dk**-0.5, hv // hk, axis=1)  # [T, Hv, Dk] float32
        k = jnp.repeat(l2_normalize(k), hv // hk, axis=1)
        beta = jax.nn.sigmoid(x @ in_b)  # [T, Hv]
        g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus((x @ in_a).astype(jnp.float32) + dt_bias)
        if state is None:
            form = delta_rule_form(jax.default_backend())
            out = gated_delta_rule(form, q, k, v, g, beta, seg)  # [T, Hv, Dv] float32
        else:
            assert paged is not None
            out, rows = paged_delta_rule(q, k, v, g, beta, state.recurrent, paged, meta.cu_q_lens, meta.num_seqs)
            state = LinearState(conv_rows, rows)
        out = out.astype(dtype)
        z = (x @ in_z).reshape(t, hv, dv)
        o32 = out.astype(jnp.float32)
        normed = (o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + c.rms_norm_eps)).astype(dtype)
        gated = (norm_weight * normed).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        return gated.astype(dtype).reshape(t, hv * dv) @ out_proj, state


__all__ = ["CHUNK_SIZE", "DeltaRuleForm", "GatedDeltaNet", "causal_conv1d", "delta_rule_form", "gated_delta_rule"]
