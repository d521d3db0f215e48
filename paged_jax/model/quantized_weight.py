"""A weight kept quantized in memory, and the w8a8 arithmetic around its int8 x int8 product.

Its own module because two dots share it: XLA's (`paged_jax.model.quant.dot`) and the CPU GEMM's
(`paged_jax.model.cpu_weights.dot`, the weight packed at load). Both quantize the activations with
:func:`quantize_tokens` and scale the exact int32 sums back with :func:`rescale`, so their results are the same
bits whenever their int32 sums are (they are: integer sums are exact in any order).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class QuantizedWeight:
    """A weight kept quantized in memory: ``w ~= values * scale``, symmetric, one scale per output channel.

    ``values`` has the float weight's shape (so Flax's shape check on ``self.param`` still holds); ``scale``
    has the shape of its output (non-contracted, trailing) axes: ``[Hq, D]`` for q_proj ``[H, Hq, D]``,
    ``[H]`` for o_proj ``[Hq, D, H]``, ``[I]`` for gate_proj ``[H, I]``. ``native_dot``: multiply as int8 x int8
    with int32 accumulation (activations quantized per token on the fly, :func:`quantize_tokens`) instead of
    casting the weight to the activation dtype: the ``w8a8`` scheme (`paged_jax.model.quant.quantize_params`).
    """

    values: jax.Array  # int8 or float8_e4m3fn, the float weight's shape
    scale: jax.Array  # float32, the weight's output axes
    native_dot: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def contract(self) -> int:
        """How many leading axes the matmul contracts."""
        return self.values.ndim - self.scale.ndim


def quantize_tokens(x: jax.Array, contract: int) -> tuple[jax.Array, jax.Array]:
    """w8a8's activations: ``x [T.., *K]`` -> (int8 ``xq [T.., *K]``, float32 ``sx [T.., 1 * contract]``) with
    ``x ~= xq * sx``, one symmetric scale per token over its `contract` trailing axes."""
    k_axes = tuple(range(x.ndim - contract, x.ndim))
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=k_axes, keepdims=True)
    sx = jnp.where(amax > 0, amax / 127.0, 1.0)
    xq = jnp.clip(jnp.round(x32 / sx), -127, 127).astype(jnp.int8)
    return xq, sx


def rescale(acc: jax.Array, sx: jax.Array, scale: jax.Array, contract: int, out_dtype) -> jax.Array:
    """The int32 sums ``acc [T.., *N]`` of :func:`quantize_tokens`' ``xq`` and a weight's values, scaled back:
    ``acc * sx * scale`` in float32 (in that order), then `out_dtype`."""
    lead = sx.shape[: sx.ndim - contract]
    sx = sx.reshape(lead + (1,) * scale.ndim)
    return (acc.astype(jnp.float32) * sx * scale).astype(out_dtype)
