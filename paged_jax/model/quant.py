"""Quantization: which KV page dtype a run stores and what a token of it costs; int8/fp8 weights.

KV pages: ``--kv-dtype`` int8 or fp8_e4m3 stores :class:`pallas_kernels.kv_quant.QuantizedPages` (values plus one
float32 scale per token, KV head and K/V; see that module for the layout and why). Weights: see
:func:`quantize_params` below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.config import KV_DTYPE_CHOICES, WEIGHT_QUANTIZATIONS, ModelConfig
from paged_jax.model import cpu_weights
from paged_jax.model.quantized_weight import QuantizedWeight, quantize_tokens, rescale
from pallas_kernels import kv_quant


def kv_cache_dtype(name: str | None, model_dtype) -> jnp.dtype:
    """The stored page dtype for ``--kv-dtype`` ``name`` (None: the model's dtype)."""
    if name is not None and name not in KV_DTYPE_CHOICES:
        raise ValueError(f"kv_dtype: must be one of {KV_DTYPE_CHOICES}, got {name!r}")
    return kv_quant.kv_dtype_from_name(name, model_dtype)


def kv_bytes_per_token(config: ModelConfig, kv_dtype) -> int:
    """Bytes of KV one token takes over all layers that keep K/V and all KV heads, scales included."""
    return config.num_kv_layers * config.num_kv_heads * kv_quant.bytes_per_token_head(config.head_dim, kv_dtype)


def kv_bytes_per_page(
    config: ModelConfig,
    kv_dtype,
    page_size: int,
    kv_shards: int = 1,
    dense: bool = False,
    num_slabs: int | None = None,
) -> int:
    """Bytes of one page over all layers (or over `num_slabs` layer slabs: KV cache groups,
    `paged_jax.kv_cache.groups`) on one of `kv_shards` chips (each holding `num_kv_heads / kv_shards` heads),
    scale rows included and padded to whole lanes when `dense` (TPU, `pallas_kernels.kv_quant.lane_dense`): what
    the engine's page budget divides by."""
    per_layer = kv_quant.page_bytes(config.num_kv_heads // kv_shards, page_size, config.head_dim, kv_dtype, dense)
    return (num_slabs or config.num_layers) * per_layer


# -- weights ------------------------------------------------------------------------------------------------

_WEIGHT_DTYPES = {"int8": jnp.dtype(jnp.int8), "w8a8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}
# The matmul weights quantized (the model's fused layout and the import layout), and how many leading axes each
# contracts: o_proj [Hq, D, H] two, every other one its first. Embeddings (a gather of T rows: memory, not
# bandwidth), norms, biases, MoE routers and experts (grouped matmuls, not through `dot`) keep their dtype.
_CONTRACT_AXES = {
    "qkv_proj": 1,
    "o_proj": 2,
    "gate_up_proj": 1,
    "down_proj": 1,
    "lm_head": 1,
    "q_proj": 1,
    "k_proj": 1,
    "v_proj": 1,
    "gate_proj": 1,
    "up_proj": 1,
}


def _is_matmul_weight(name: str, ndim: int, lm_head: bool) -> bool:
    return name in _CONTRACT_AXES and ndim >= 2 and (lm_head or name != "lm_head")


def quantize_weight(w: jax.Array, contract: int, quantization: str, native_dot: bool = False) -> QuantizedWeight:
    """Per-output-channel symmetric quantization of ``w`` contracted over its first ``contract`` axes."""
    dtype = _WEIGHT_DTYPES[quantization]
    w32 = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=tuple(range(contract)))
    scale = jnp.where(amax > 0, amax / kv_quant.qmax(dtype), 1.0)
    y = w32 / scale
    if dtype == jnp.int8:
        y = jnp.clip(jnp.round(y), -127, 127)
    return QuantizedWeight(y.astype(dtype), scale.astype(jnp.float32), native_dot and dtype == jnp.int8)


def quantize_params(params, quantization: str | None, *, lm_head: bool = True, native_dot: bool | None = None):
    """Params with every projection matrix (and the untied LM head unless ``lm_head=False``) replaced by a
    :class:`QuantizedWeight`; embeddings, norms and biases keep their dtype. ``None`` returns ``params``."""
    if quantization is None:
        return params
    if quantization not in WEIGHT_QUANTIZATIONS:
        raise ValueError(f"quantization: must be one of {WEIGHT_QUANTIZATIONS}, got {quantization!r}")
    native = quantization == "w8a8" if native_dot is None else native_dot

    def one(path, leaf):
        name = str(getattr(path[-1], "key", path[-1]))
        if not _is_matmul_weight(name, leaf.ndim, lm_head):
            return leaf
        return quantize_weight(leaf, _CONTRACT_AXES[name], quantization, native)

    return jax.tree_util.tree_map_with_path(one, params)


def _dot_general(x: jax.Array, w: jax.Array, contract: int, batch: int, preferred_element_type) -> jax.Array:
    """x [T.., *K] . w [*K, *B, *N] -> [T.., *B, *N]; `batch` > 0: as a dot batched over w's `batch` axes B
    after the contracted ones, x broadcast over them (the same products and sums, B outer)."""
    t = x.ndim - contract
    if not batch:
        dims = ((tuple(range(t, x.ndim)), tuple(range(contract))), ((), ()))
        return jax.lax.dot_general(x, w, dims, preferred_element_type=preferred_element_type)
    b = tuple(range(batch))
    wb = jnp.moveaxis(w, tuple(range(contract, contract + batch)), b)  # [*B, *K, *N]
    xb = jnp.broadcast_to(x, w.shape[contract : contract + batch] + x.shape)  # [*B, T.., *K]
    bdims = ((tuple(range(batch + t, batch + x.ndim)), tuple(range(batch, batch + contract))), (b, b))
    out = jax.lax.dot_general(xb, wb, bdims, preferred_element_type=preferred_element_type)  # [*B, T.., *N]
    return jnp.moveaxis(out, b, tuple(range(t, t + batch)))


def dot(x: jax.Array, w, contract: int = 1, preferred_element_type=None, batch: int = 0) -> jax.Array:
    """``x [T, *K] . w [*K, *N] -> [T, *N]``, contracting x's last and w's first ``contract`` axes, for a plain
    weight, a :class:`QuantizedWeight` (the scale applied to the output, in float32) or a CPU-packed one
    (`paged_jax.model.cpu_weights`). The result has x's
    dtype, or ``preferred_element_type``. ``batch``: the first ``batch`` output axes of w become batch axes of
    the dot (x broadcast over them): the same result, a form XLA:TPU reads a head-major weight with in place
    (``paged_jax.model.layers.qkv_projection``)."""
    out_dtype = preferred_element_type or x.dtype
    if isinstance(w, cpu_weights.CpuWeight):  # packed at load for the CPU GEMM
        return cpu_weights.dot(x, w, contract, preferred_element_type, batch)
    if not isinstance(w, QuantizedWeight):
        return _dot_general(x, w, contract, batch, preferred_element_type)
    if w.contract != contract:
        raise ValueError(f"weight contracts {w.contract} axes, the call {contract}")
    if w.native_dot:  # per-token int8 activations; int8 x int8 -> int32
        xq, sx = quantize_tokens(x, contract)
        acc = _dot_general(xq, w.values, contract, batch, jnp.int32)
        return rescale(acc, sx, w.scale, contract, out_dtype)
    acc = _dot_general(x, w.values.astype(x.dtype), contract, batch, jnp.float32)
    return (acc * w.scale).astype(out_dtype)


def to_storable(params):
    """Quantized weights as plain dicts ``{"qvalues", "qscale"}`` (what orbax checkpoints hold)."""
    return jax.tree.map(
        lambda w: {"qvalues": w.values, "qscale": w.scale} if isinstance(w, QuantizedWeight) else w,
        params,
        is_leaf=lambda x: isinstance(x, QuantizedWeight),
    )


def from_storable(params, native_dot: bool = False):
    """Inverse of :func:`to_storable`; ``native_dot`` for w8a8 weights."""
    native = native_dot

    def walk(node):
        if isinstance(node, dict) and set(node) == {"qvalues", "qscale"}:
            return QuantizedWeight(node["qvalues"], node["qscale"], native and node["qvalues"].dtype == jnp.int8)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(params)


def storable_shapes(param_shapes, quantization: str, *, lm_head: bool = True):
    """The abstract tree :func:`to_storable` produces for quantized params of these float shapes."""
    dtype = _WEIGHT_DTYPES[quantization]

    def one(path, leaf):
        name = str(getattr(path[-1], "key", path[-1]))
        if not _is_matmul_weight(name, len(leaf.shape), lm_head):
            return leaf
        contract = _CONTRACT_AXES[name]
        return {
            "qvalues": jax.ShapeDtypeStruct(leaf.shape, dtype),
            "qscale": jax.ShapeDtypeStruct(leaf.shape[contract:], jnp.float32),
        }

    return jax.tree_util.tree_map_with_path(one, param_shapes)


def scheme_of(params) -> dict | None:
    """``{"quantization": "int8" | "w8a8" | "fp8", "lm_head": bool}`` of quantized params, None for float ones."""
    found = [
        w
        for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
        if isinstance(w, QuantizedWeight)
    ]
    if not found:
        return None
    name = "fp8" if found[0].values.dtype != jnp.int8 else "w8a8" if found[0].native_dot else "int8"
    lm_head = isinstance(params.get("params", {}).get("lm_head"), QuantizedWeight)
    return {"quantization": name, "lm_head": lm_head}


def weights_key(params) -> tuple[str, bool, bool] | None:
    """Hashable description of quantized params' tree: (scheme, LM head quantized, native dot); None if float."""
    scheme = scheme_of(params)
    if scheme is None:
        return None
    return scheme["quantization"], scheme["lm_head"], scheme["quantization"] == "w8a8"


def abstract_params(param_shapes, key: tuple[str, bool, bool] | None):
    """The abstract parameter tree of :func:`weights_key` ``key`` built from the float shapes."""
    if key is None:
        return param_shapes
    quantization, lm_head, native = key
    return from_storable(storable_shapes(param_shapes, quantization, lm_head=lm_head), native)
