"""How fast does this platform copy KV pages and compute a prefill? The swap cost model's rates.

`paged_jax.kv_cache.swap.SwapCosts` weighs copying a preempted request's pages out and back against recomputing
its context. Its two rates come from here: measured at the engine's warm-up (`measure_copy_rate`: one gather of the
largest copy bucket landed in host memory and one scatter back, timed after they are compiled; `measure_flops_rate`:
a square matmul in the model's dtype), or, without a warm-up, the platform's configured defaults
(`DEFAULT_RATES`), which only need to be right to within the wide margin between the two costs on real models.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.kv_cache import SwapCosts
from paged_jax.worker.kv_transfer import COPY_BUCKETS, KVTransfer

# (host <-> device bytes/s, prefill FLOP/s) per platform, when nothing was measured.
DEFAULT_RATES: dict[str, tuple[float, float]] = {
    "cpu": (4e9, 5e10),  # a memory copy; a few cores' matmuls
    "tpu": (8e9, 1e14),  # a host link shared by the chips; about half a v5e's bfloat16 peak
    "gpu": (2e10, 2e14),  # PCIe; a fraction of a datacenter GPU's bfloat16 peak
}
MATMUL_SIZE = 1024  # of the square matmul that measures the FLOP rate


def prefill_flops(params, config) -> tuple[float, float]:
    """(FLOPs per token beside attention: 2 x parameters; attention FLOPs per token per earlier token: 4 x layers
    x query width, the scores and the weighted sum)."""
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return 2.0 * num_params, 4.0 * config.num_layers * config.num_heads * config.head_dim


def measure_copy_rate(transfer: KVTransfer, kv_caches, repeats: int = 3) -> tuple[float, Any]:
    """Bytes per second of a device -> host gather landed in numpy and a host -> device scatter (the largest copy
    bucket, both directions averaged), best of `repeats`; the executables are compiled first (the warm-up's
    `compile_all` did). The copies touch page 0 (the null page, never read as KV) and host slot 0 only.

    Returns the caches (the scatter donates them)."""
    n = COPY_BUCKETS[-1]
    leaves = jax.tree.leaves(kv_caches)
    pages = np.zeros(n, np.int32)  # the null page
    gather = transfer._executable("gather", n, leaves)
    scatter = transfer._executable("scatter", n, leaves)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        rows = [np.asarray(x) for x in gather(leaves, pages)]
        leaves = scatter(leaves, np.full(n, transfer.pad, np.int32), rows)  # padding rows: written nowhere
        jax.block_until_ready(leaves)
        best = min(best, time.perf_counter() - t0)
    nbytes = 2 * n * transfer.tier.page_bytes
    return (nbytes / best if best > 0 else float("inf")), jax.tree.unflatten(transfer.treedef, leaves)


def measure_flops_rate(dtype, repeats: int = 3) -> float:
    """FLOPs per second of a square matmul in `dtype` on the default device, best of `repeats`."""
    a = jnp.ones((MATMUL_SIZE, MATMUL_SIZE), dtype)
    f = jax.jit(lambda x: x @ x).lower(a).compile()
    jax.block_until_ready(f(a))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a))
        best = min(best, time.perf_counter() - t0)
    return 2 * MATMUL_SIZE**3 / best if best > 0 else float("inf")


def swap_costs(params, config, page_bytes: int, platform: str, measured: tuple[float, float] | None) -> SwapCosts:
    """The cost model's inputs: `measured` (copy bytes/s, FLOP/s), else the platform's defaults."""
    copy, flops = measured or DEFAULT_RATES.get(platform, DEFAULT_RATES["gpu"])
    per_token, attention = prefill_flops(params, config)
    return SwapCosts(copy, flops, per_token, attention, page_bytes)
