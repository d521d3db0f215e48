"""The CPU-weights record: the projection weights packed once, at load, for the CPU GEMM (`pallas_kernels.cpu.gemm`).

Why: on CPU most of a decode step is its weight dots at a few rows, and XLA's dot libraries get each weight in its
stored layout on every call (repacking it, or reading it with strided panel loads). The record holds each
projection (fused QKV, o, fused gate/up, down, the LM head) in the GEMM's panel layout, as a second Flax
collection beside ``params`` (``{"params": ..., CPU_WEIGHTS: ...}``): the modules read a weight from the record
where it has one (`paged_jax.model.decoder.weight`), else from ``params``. The packed weights replace their
``params`` leaves in the runner's tree only (the tied embedding stays: it is also the embedding lookup), so memory
does not double; checkpoints, the loader's tree, tensor-parallel shardings and the TPU/GPU steps never see it.

What is packed: float32 and bfloat16 weights of the dense families whose layers are `paged_jax.model.decoder`'s
``Attention`` and ``GatedMLP`` (:data:`FAMILIES`), on one CPU device, unrolled decoder, and their ``w8a8`` int8
weights (`paged_jax.model.quantized_weight.QuantizedWeight` with ``native_dot``): packed as int8 with their
per-channel scales beside, the activations quantized per token and the int32 sums scaled back exactly as XLA's
w8a8 dot does (:func:`dot`). Weight-only int8 and fp8 weights (cast to the activations' dtype before the dot)
stay on XLA's dots; LoRA deltas stay their own low-rank dots on the same activations (`paged_jax.lora.delta`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, TypeGuard

import flax
import jax
import jax.numpy as jnp

from paged_jax.model.quantized_weight import QuantizedWeight, quantize_tokens, rescale
from pallas_kernels.cpu import gemm

CPU_WEIGHTS = "cpu_weights"  # the record's Flax collection
ENV = "PAGED_JAX_CPU_GEMM"  # "0": no record (XLA's dots), e.g. for an A/B
# Families whose attention and MLP are decoder.Attention and decoder.GatedMLP (the modules that read the record).
FAMILIES = frozenset({"llama", "qwen3", "gemma2", "gemma3"})
# Per layer: (block, weight, contracted axes), as paged_jax.model.layers calls quant.dot.
LAYER_WEIGHTS = (
    ("self_attn", "qkv_proj", 1),
    ("self_attn", "o_proj", 2),
    ("mlp", "gate_up_proj", 1),
    ("mlp", "down_proj", 1),
)


@flax.struct.dataclass
class CpuWeight:
    """One packed weight and the stored weight's shape ``[*k_shape, *n_shape]`` (the dot's contracted and output
    axes). `library`: the GEMM build it was packed for (its cache file name, keyed by sources, flags and CPU), part
    of the tree's structure, so a stored executable of another build never matches the runner's key. `scale`: a
    w8a8 weight's float32 per-channel scales ``[*n_shape]`` (its packed values int8), None for a float weight."""

    packed: gemm.PackedWeight
    k_shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
    n_shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
    library: str = flax.struct.field(pytree_node=False, default="")
    scale: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PackReport:
    """What packing at load did: weights packed, their bytes, wall and CPU seconds, the GEMM's ISA path."""

    weights: int
    bytes: int
    seconds: float
    cpu_seconds: float
    isa: str


def wanted(model_type: str, platform: str, scan: bool, mesh: Any, abstract: bool) -> bool:
    """Whether a runner packs its weights: one CPU device, unrolled decoder, a family in :data:`FAMILIES`,
    ``$PAGED_JAX_CPU_GEMM`` not "0", and the GEMM built for the ISA path. An abstract runner (AOT checks) packs
    its shapes (:func:`pack_params` on ``ShapeDtypeStruct`` leaves), so it lowers the step a real one runs."""
    if platform != "cpu" or scan or mesh is not None or model_type not in FAMILIES:
        return False
    return os.environ.get(ENV, "1") != "0" and gemm.available()


def _packable(w: Any) -> TypeGuard[jax.Array | QuantizedWeight]:
    if isinstance(w, QuantizedWeight):  # w8a8's int8 x int8 dot; weight-only int8 / fp8 cast on XLA's dots
        return w.native_dot and w.values.dtype == gemm.INT8 and math.prod(w.shape[: w.contract]) <= gemm.MAX_INT8_K
    return isinstance(w, jax.Array | jax.ShapeDtypeStruct) and w.dtype in gemm.DTYPES


def _abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def pack_params(params: dict, config: Any) -> tuple[dict, PackReport]:
    """``{"params": ...}`` -> ``{"params": ... without the packed leaves, CPU_WEIGHTS: record}`` (the record's tree
    mirrors ``params``: ``layers_i/self_attn/qkv_proj`` ..., ``lm_head``) and what it did. Float arrays and w8a8
    weights are packed; other quantized leaves are left where they are."""
    kern = gemm.kernel()
    if kern is None:
        raise RuntimeError("the CPU GEMM is not available")
    t0, c0 = time.perf_counter(), time.process_time()
    tree = dict(params["params"])
    record: dict[str, Any] = {}
    count = nbytes = 0

    def pack(w: jax.Array | jax.ShapeDtypeStruct | QuantizedWeight, contract: int) -> CpuWeight:
        nonlocal count, nbytes
        scale = w.scale if isinstance(w, QuantizedWeight) else None
        values = w.values if isinstance(w, QuantizedWeight) else w
        k_shape, n_shape = tuple(values.shape[:contract]), tuple(values.shape[contract:])
        k, n = math.prod(k_shape), math.prod(n_shape)
        if isinstance(values, jax.ShapeDtypeStruct):  # an abstract runner's: the packed arrays' specs
            shape = gemm.packed_shape(k, n, kern.nr, values.dtype)
            spec = jax.ShapeDtypeStruct(shape, values.dtype, sharding=values.sharding)
            comp = None
            if values.dtype == gemm.INT8:
                comp = jax.ShapeDtypeStruct((shape[0] * kern.nr,), jnp.int32, sharding=values.sharding)
            packed = gemm.PackedWeight(spec, k, n, kern.nr, comp)  # type: ignore[arg-type]  # specs stand in
        else:
            packed = gemm.pack(values.reshape(k, n), kern.nr)
        arrays = [a for a in (packed.packed, packed.comp, scale) if a is not None]
        count, nbytes = count + 1, nbytes + sum(math.prod(a.shape) * a.dtype.itemsize for a in arrays)
        return CpuWeight(packed, k_shape, n_shape, kern.library.name, scale)

    for i in range(config.num_layers):
        name = f"layers_{i}"
        layer = {block: dict(v) for block, v in tree[name].items()} if name in tree else {}
        for block, weight, contract in LAYER_WEIGHTS:
            w = layer.get(block, {}).get(weight)
            if _packable(w):
                record.setdefault(name, {}).setdefault(block, {})[weight] = pack(w, contract)
                del layer[block][weight]
        tree[name] = layer
    if config.tie_word_embeddings:  # the embedding [V, H] is also the lookup table: it stays, packed as [H, V]
        emb = tree["embed_tokens"]["embedding"]
        if _packable(emb) and not isinstance(emb, QuantizedWeight):
            t = jax.ShapeDtypeStruct(emb.shape[::-1], emb.dtype, sharding=emb.sharding) if _abstract(emb) else emb.T
            record["lm_head"] = pack(t, 1)
    elif _packable(head := tree.get("lm_head")):
        record["lm_head"] = pack(head, 1)
        del tree["lm_head"]
    out = {**params, "params": tree, CPU_WEIGHTS: record}
    jax.block_until_ready([x for x in jax.tree.leaves(out) if not _abstract(x)])
    return out, PackReport(count, nbytes, time.perf_counter() - t0, time.process_time() - c0, kern.isa)


def dot(x: jax.Array, w: CpuWeight, contract: int, preferred_element_type=None, batch: int = 0) -> jax.Array:
    """`paged_jax.model.quant.dot` for a packed weight: ``x [T, *K] -> [T, *N]`` in x's dtype or
    ``preferred_element_type`` (float32 accumulation either way). A w8a8 weight: x quantized per token, the
    GEMM's exact int32 sums scaled back (`paged_jax.model.quantized_weight`): XLA's w8a8 dot, bit for bit."""
    if batch or contract != len(w.k_shape) or x.shape[x.ndim - contract :] != w.k_shape:
        raise ValueError(
            f"packed CPU weight {w.k_shape} x {w.n_shape}: cannot contract x {x.shape} over {contract} axes "
            f"(batch {batch})"
        )
    lead = x.shape[: x.ndim - contract]
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    if w.scale is not None:  # w8a8
        xq, sx = quantize_tokens(x, contract)
        acc = gemm.matmul(xq.reshape(-1, w.packed.k), w.packed).reshape(*lead, *w.n_shape)
        return rescale(acc, sx, w.scale, contract, out_dtype)
    if x.dtype != w.packed.dtype:
        raise ValueError(f"packed CPU weight is {w.packed.dtype}, x is {x.dtype}")
    y = gemm.matmul(x.reshape(-1, w.packed.k), w.packed, out_dtype=out_dtype)
    return y.reshape(*lead, *w.n_shape)
