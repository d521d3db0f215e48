"""Building blocks of the Llama decoder: RMSNorm, rotary embeddings, the projections, SwiGLU MLP.

The projections are plain functions over a layer's parameter dict (`qkv_projection`, `out_projection`,
`gated_mlp`): one call site each, used by the modules and by `scripts/bench/profile_decode.py`. Each takes the
layer's optional `LoraLayer` and adds the batch's LoRA deltas to its outputs (`paged_jax.lora.delta`).

Numerics follow Hugging Face transformers: RMSNorm in float32 then cast back before the weight;
RoPE frequencies and rotation in float32 with the non-interleaved `rotate_half` convention.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.config import ModelConfig, RopeScaling
from paged_jax.lora import delta
from paged_jax.lora.delta import LoraLayer
from paged_jax.model import quant

Initializer = nn.initializers.Initializer
INIT_STD = 0.02  # HF `initializer_range`
kernel_init: Initializer = nn.initializers.normal(INIT_STD)


# The fused q/k/v layout (per KV head: its G query heads, then K, then V; `paged_jax.model.loader.fuse`
# says why), used by the projection below and by the loaders that build it.
def fuse_qkv(q: jax.Array, k: jax.Array, v: jax.Array, group: int) -> jax.Array:
    """[..., Hq, D], [..., Hkv, D], [..., Hkv, D] -> [..., Hkv, group + 2, D] (per-KV-head groups)."""
    *lead, hkv, d = k.shape
    q = q.reshape(*lead, hkv, group, d)
    return jnp.concatenate([q, k[..., None, :], v[..., None, :]], axis=-2)


def split_qkv(qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The inverse of `fuse_qkv`: [..., Hkv, G + 2, D] -> q [..., Hkv * G, D], k and v [..., Hkv, D]."""
    *lead, hkv, g2, d = qkv.shape
    return qkv[..., : g2 - 2, :].reshape(*lead, hkv * (g2 - 2), d), qkv[..., g2 - 2, :], qkv[..., g2 - 1, :]


class RMSNorm(nn.Module):
    """y = weight * (x * rsqrt(mean(x^2) + eps)); statistics in float32. x: [..., H] -> [..., H]."""

    hidden_size: int
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (self.hidden_size,), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return weight * x32.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] float32, with Llama-3 scaling when given (HF's formula)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(theta) ** exponent)).astype(np.float32)
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin: [T, D] float32 for positions [T] (the D/2 frequencies repeated twice, HF layout)."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [T, H, D] by cos/sin [T, R] in float32 (x * cos + rotate_half(x) * sin); keeps x.dtype. With R < D
    (partial rotary, Qwen3.5) only the first R dims of each head rotate and the rest pass through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], axis=-1)
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def qkv_projection(
    x: jax.Array, attn: dict, config: ModelConfig, lora: LoraLayer | None = None, head_batched: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [T, Hq, D], k and v [T, Hkv, D] from x [T, H]: one matmul with the fused `qkv_proj` [H, Hkv, G + 2, D]
    (layout: `paged_jax.model.loader.fuse`), its bias added when the model has one, then the LoRA deltas (on the
    fused output, before the split).
    `head_batched`: the matmul written as one batched over (Hkv, G + 2), x broadcast, for a weight stored
    head-major ([Hkv, G + 2, H, D]: `paged_jax.model.scan.head_batched_qkv` says why); the same sums."""
    qkv = quant.dot(x, attn["qkv_proj"], batch=2 if head_batched else 0)  # [T, Hkv, G + 2, D]
    if config.attention_bias:
        qkv = qkv + attn["qkv_bias"]
    return split_qkv(qkv if lora is None else delta.add_qkv(x, qkv, lora))


def out_projection(out: jax.Array, attn: dict, lora: LoraLayer | None = None) -> jax.Array:
    """The attention output [T, Hq, D] projected back to [T, H] by `o_proj` [Hq, D, H] (plus its LoRA delta)."""
    y = quant.dot(out, attn["o_proj"], 2)
    return y if lora is None else delta.add_o(y, out, lora)


def gated_mlp(x: jax.Array, mlp: dict, activation=jax.nn.silu, lora: LoraLayer | None = None) -> jax.Array:
    """down(act(gate(x)) * up(x)) (SwiGLU with silu): x [T, H] -> [T, H], gate and up as one matmul with
    `gate_up_proj` [H, 2, I], then `down_proj` [I, H]; LoRA deltas on gate/up (fused) and down when given."""
    gate_up = quant.dot(x, mlp["gate_up_proj"])  # [T, 2, I]
    if lora is not None:
        gate_up = delta.add_gate_up(x, gate_up, lora)
    gate, up = gate_up[:, 0], gate_up[:, 1]
    h = activation(gate) * up
    y = quant.dot(h, mlp["down_proj"])
    return y if lora is None else delta.add_down(y, h, lora)
