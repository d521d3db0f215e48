"""The GPU kernel's tuning table: block configs keyed by head_dim, page size and dtype, with a heuristic fallback.

:func:`pallas_kernels.gpu.plan.plan_gpu` takes each range's query rows, KV keys per step, warps and stages from
here (the ``sweep`` group of ``scripts/checks/gpu_check.py --part 2`` measures replacements on a GPU)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Tiling of one kind of range: query rows per program, keys per KV step, Triton launch options."""

    rows: int  # target rows of a program's q tile (tokens x padded group), >= 16
    kv_keys: int  # keys per KV step (pages_per_block * page_size)
    num_warps: int
    num_stages: int


# (head_dim, page_size, dtype name) -> (decode config, prefill config). Starting points from the public Triton
# flash-attention / vLLM unified-attention tunings for Hopper, NOT yet measured on our kernel (no GPU has run
# it): decode tiles are the 16-row MMA minimum with long KV steps and 3-4 stage pipelines (bandwidth-bound),
# prefill tiles 64-128 rows with 64-key steps (register-bound accumulators).
TUNED_BLOCK_CONFIGS: dict[tuple[int, int, str], tuple[BlockConfig, BlockConfig]] = {
    (64, 16, "bfloat16"): (BlockConfig(16, 128, 4, 4), BlockConfig(128, 64, 4, 3)),
    (64, 32, "bfloat16"): (BlockConfig(16, 128, 4, 4), BlockConfig(128, 64, 4, 3)),
    (64, 64, "bfloat16"): (BlockConfig(16, 128, 4, 4), BlockConfig(128, 64, 4, 3)),
    (128, 16, "bfloat16"): (BlockConfig(16, 64, 4, 3), BlockConfig(128, 64, 8, 3)),
    (128, 32, "bfloat16"): (BlockConfig(16, 64, 4, 3), BlockConfig(128, 64, 8, 3)),
    (128, 64, "bfloat16"): (BlockConfig(16, 64, 4, 3), BlockConfig(128, 64, 8, 3)),
    (256, 16, "bfloat16"): (BlockConfig(16, 32, 4, 3), BlockConfig(64, 32, 8, 2)),
    (256, 32, "bfloat16"): (BlockConfig(16, 32, 4, 3), BlockConfig(64, 32, 8, 2)),
    (256, 64, "bfloat16"): (BlockConfig(16, 64, 4, 2), BlockConfig(64, 64, 8, 2)),
}


def block_configs(head_dim: int, page_size: int, dtype: Any) -> tuple[BlockConfig, BlockConfig]:
    """``(decode, prefill)`` configs: the table's entry, else a heuristic (float32 halves the KV step)."""
    name = jnp.dtype(dtype).name
    if (head_dim, page_size, name) in TUNED_BLOCK_CONFIGS:
        return TUNED_BLOCK_CONFIGS[(head_dim, page_size, name)]
    scale = 2 if name == "float32" else 1
    decode_keys = max(16, 8192 // head_dim // scale)  # 64 keys at head_dim 128 (bf16)
    prefill_rows = 128 if head_dim <= 128 else 64
    return (
        BlockConfig(16, decode_keys, 4, 3 if scale == 1 else 2),
        BlockConfig(prefill_rows, max(16, 64 // scale), 8 if head_dim >= 128 else 4, 2),
    )
