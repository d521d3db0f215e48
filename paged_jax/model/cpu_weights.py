"""The CPU-weights record: the projection weights packed once, at load, for the CPU GEMM (`pallas_kernels.cpu.gemm`).

Why: on CPU most of a decode step is its weight dots at a few rows, and XLA's dot libraries get each weight in its
stored layout on every call (repacking it, or reading it with strided panel loads). The record holds each
projection (fused QKV, o, fused gate/up, down, the LM head) in the GEMM's panel layout, as a second Flax
collection beside ``params`` (``{"params": ..., CPU_WEIGHTS: ...}``): the modules read a weight from the record
where it has one (`paged_jax.model.decoder.weight`), else from ``params``. The packed weights replace their
``params`` leaves in the runner's tree only (the tied embedding stays: it is also the embedding lookup), so memory
does not double; checkpoints, the loader's tree, tensor-parallel shardings and the TPU/GPU steps never see it.

What is packed: float32 and bfloat16 weights of the dense families whose layers are `paged_jax.model.decoder`'s
``Attention`` and ``GatedMLP`` (:data:`FAMILIES`), on one CPU device, unrolled decoder. Quantized weights
(`paged_jax.model.quant.QuantizedWeight`) stay on XLA's dots with their scales; LoRA deltas stay their own
low-rank dots on the same activations (`paged_jax.lora.delta`).
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
    of the tree's structure, so a stored executable of another build never matches the runner's key."""

    packed: gemm.PackedWeight
    k_shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
    n_shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
    library: str = flax.struct.field(pytree_node=False, default="")


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


def _packable(w: Any) -> TypeGuard[jax.Array]:
    return isinstance(w, jax.Array | jax.ShapeDtypeStruct) and w.dtype in gemm.DTYPES


def _abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def pack_params(params: dict, config: Any) -> tuple[dict, PackReport]:
    """``{"params": ...}`` -> ``{"params": ... without the packed leaves, CPU_WEIGHTS: record}`` (the record's tree
    mirrors ``params``: ``layers_i/self_attn/qkv_proj`` ..., ``lm_head``) and what it did. Leaves other than float
    arrays (quantized ones) are left where they are."""
    kern = gemm.kernel()
    if kern is None:
        raise RuntimeError("the CPU GEMM is not available")
    t0, c0 = time.perf_counter(), time.process_time()
    tree = dict(params["params"])
    record: dict[str, Any] = {}
    count = nbytes = 0

    def pack(w: jax.Array | jax.ShapeDtypeStruct, contract: int) -> CpuWeight:
        nonlocal count, nbytes
        k_shape, n_shape = tuple(w.shape[:contract]), tuple(w.shape[contract:])
        k, n = math.prod(k_shape), math.prod(n_shape)
        if isinstance(w, jax.ShapeDtypeStruct):  # an abstract runner's: the packed array's spec
            spec = jax.ShapeDtypeStruct(gemm.packed_shape(k, n, kern.nr, w.dtype), w.dtype, sharding=w.sharding)
            packed = gemm.PackedWeight(spec, k, n, kern.nr)  # type: ignore[arg-type]  # a spec stands in for the array
        else:
            packed = gemm.pack(w.reshape(k, n), kern.nr)
        count, nbytes = count + 1, nbytes + math.prod(packed.packed.shape) * packed.packed.dtype.itemsize
        return CpuWeight(packed, k_shape, n_shape, kern.library.name)

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
        if _packable(emb):
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
    ``preferred_element_type`` (float32 accumulation either way)."""
    if batch or contract != len(w.k_shape) or x.shape[x.ndim - contract :] != w.k_shape:
        raise ValueError(
            f"packed CPU weight {w.k_shape} x {w.n_shape}: cannot contract x {x.shape} over {contract} axes "
            f"(batch {batch})"
        )
    if x.dtype != w.packed.dtype:
        raise ValueError(f"packed CPU weight is {w.packed.dtype}, x is {x.dtype}")
    lead = x.shape[: x.ndim - contract]
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    y = gemm.matmul(x.reshape(-1, w.packed.k), w.packed, out_dtype=out_dtype)
    return y.reshape(*lead, *w.n_shape)
