"""Shared pieces of the paged-attention backends: layout, masking convention, validation.

Layout of one layer's KV pages (every backend reads exactly this)::

        kv_pages: [num_pages, num_kv_heads, page_size, 2 * head_dim]

K of KV head ``h`` in slot ``s`` of page ``p`` is ``kv_pages[p, h, s, :head_dim]`` and its V is
``kv_pages[p, h, s, head_dim:]``. Why this layout:
- One page of one layer is one contiguous slab (all heads), so a page is one DMA or one gather row.
- The two minor axes, ``[page_size, 2 * head_dim]``, are what TPU tiles: ``2 * head_dim`` is a multiple of 128
  lanes for every supported head_dim (64 included: K and V share the 128 lanes of a row), and ``page_size``
  (>= 16) fills the 8/16-row sublane tile whatever the number of KV heads. The array is stored in its natural
  tiled layout, so nothing (neither XLA around the kernel nor Mosaic) has to relayout or copy it. The layout
  it replaces (``[pages, page_size, 2 * heads, head_dim]``) padded head_dim 64 to 128 lanes and small head
  counts to a full sublane tile, and the compiled TPU step copied whole caches to relayout them.
- K and V of a head are lane-aligned halves of the same rows: no strided loads, no bit tricks.
- Tensor parallelism splits axis 1 (KV heads); each shard is again this layout.
Page 0 is the null page that padding entries of the block tables point at; its contents are never used.

Ragged batch: the queries of all sequences are flattened to ``[num_tokens, num_q_heads, head_dim]``; sequence
``s`` owns tokens ``cu_q_lens[s]:cu_q_lens[s + 1]`` and has ``kv_lens[s]`` keys (the new tokens included:
their K/V were written into the pages before attention). Only the first ``num_seqs[0]`` sequences are real;
tokens past ``cu_q_lens[num_seqs[0]]`` are padding and their output rows are zeros.

Masking convention (causal inside each sequence, optional sliding window ``w``): query ``i`` of a sequence
with ``q_len`` queries and ``kv_len`` keys sits at position ``x = kv_len - q_len + i``; key position ``p`` is
visible iff ``x - w < p <= x``, i.e. a query sees itself and the ``w - 1`` keys before it (Hugging Face
Mistral's convention: ``w`` keys in the window). Without a window every ``p <= x`` is visible.

Logits are ``sm_scale * q.k``, then ``soft_cap * tanh(logits / soft_cap)`` when a soft cap is given, then the
mask. Masked logits get the finite :data:`MASK_VALUE` (never ``-inf``), so ``max - max`` stays finite, and
their probabilities are set to exactly zero, so a fully masked row yields zeros."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
BACKENDS = (
    "auto",
    "xla",
    "cpu",
    "pallas",
    "pallas-interpret",
    "pallas-tpu",
    "pallas-gpu",
    "pallas-tpu-interpret",
    "pallas-gpu-interpret",
)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# Stored page dtypes: float pages, and quantized pages with per-row scales (pallas_kernels.kv_quant).
KV_PAGE_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn))
MIN_PAGE_SIZE, MAX_PAGE_SIZE = 8, 256


def apply_soft_cap(logits: jax.Array, soft_cap: float | None) -> jax.Array:
    """``soft_cap * tanh(logits / soft_cap)``, or ``logits`` unchanged when ``soft_cap`` is None."""
    if soft_cap is None:
        return logits
    return soft_cap * jnp.tanh(logits / soft_cap)


def visible(q_pos: jax.Array, k_pos: jax.Array, sliding_window: int | None) -> jax.Array:
    """Causal (and sliding-window) visibility of key ``k_pos`` to query ``q_pos`` (broadcasts)."""
    ok = k_pos <= q_pos
    if sliding_window is not None:
        ok = ok & (k_pos > q_pos - sliding_window)
    return ok


def validate_static(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    backend: str,
) -> None:
    """Checks shapes, dtypes and static options at trace time; raises ``ValueError``."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    if kv_pages.ndim != 4:
        raise ValueError(f"kv_pages must be [num_pages, num_kv_heads, page_size, 2 * head_dim], got {kv_pages.shape}")
    _, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, kv_width = kv_pages.shape
    if kv_width != 2 * head_dim:
        raise ValueError(f"kv_pages axis 3 must be 2 * head_dim = {2 * head_dim} (K then V), got {kv_width}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if q.dtype not in (jnp.float32, jnp.bfloat16) or kv_pages.dtype not in KV_PAGE_DTYPES:
        raise ValueError(
            f"q must be float32 or bfloat16 and kv_pages one of {KV_PAGE_DTYPES}, got {q.dtype} and {kv_pages.dtype}"
        )
    if kv_lens.ndim != 1 or block_tables.ndim != 2 or kv_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(
            f"kv_lens [max_seqs] and block_tables [max_seqs, max_blocks] disagree: "
            f"{kv_lens.shape}, {block_tables.shape}"
        )
    if cu_q_lens.shape != (kv_lens.shape[0] + 1,):
        raise ValueError(f"cu_q_lens must be [max_seqs + 1] = [{kv_lens.shape[0] + 1}], got {cu_q_lens.shape}")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs must have shape [1], got {num_seqs.shape}")
    for name, arr in (
        ("kv_lens", kv_lens),
        ("block_tables", block_tables),
        ("cu_q_lens", cu_q_lens),
        ("num_seqs", num_seqs),
    ):
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {arr.dtype}")
    if not isinstance(sm_scale, (int, float)):
        raise ValueError(f"sm_scale must be a static Python float, got {type(sm_scale)}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be None or > 0, got {soft_cap}")
    if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window > 0):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def validate_kernel_shape(head_dim: int, page_size: int) -> None:
    """The Pallas kernels' extra constraints (the XLA path takes any shape)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"Pallas kernels support head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if not (MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE) or page_size & (page_size - 1):
        raise ValueError(
            f"Pallas kernels support power-of-two page sizes {MIN_PAGE_SIZE}..{MAX_PAGE_SIZE}, got {page_size}"
        )


def kv_pages_shape(num_pages: int, num_kv_heads: int, page_size: int, head_dim: int) -> tuple[int, ...]:
    """The shape of one layer's page array (see the module docstring)."""
    return (num_pages, num_kv_heads, page_size, 2 * head_dim)


def kv_dims(kv_pages: jax.Array) -> tuple[int, int, int, int]:
    """``(num_pages, num_kv_heads, page_size, head_dim)`` of a page array."""
    num_pages, num_kv_heads, page_size, width = kv_pages.shape
    return num_pages, num_kv_heads, page_size, width // 2


def cdiv(a, b: int):
    """``ceil(a / b)`` for ints and integer arrays (numpy or jax) alike: the one ceiling division of the project."""
    return -(-a // b)
