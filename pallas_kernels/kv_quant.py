"""Quantized KV pages (int8, fp8_e4m3): the stored form, its scales, and how a row is (de)quantized.

A quantized layer cache is a :class:`QuantizedPages` pair::

        pages:  [num_pages, num_kv_heads, page_size, 2 * head_dim]   int8 or float8_e4m3fn (layout of common)
        scales: [num_pages, width]                                   float32, width >= num_kv_heads * 2 * page_size

The scale of K (``kv = 0``) or V (``kv = 1``) of KV head ``h`` in slot ``s`` of page ``p`` is
``scales[p, (2 * h + kv) * page_size + s]``; the real value is ``pages[...] * scale``. Symmetric, one scale per
(token, KV head, K/V): ``scale = max|x| / qmax`` over the ``head_dim`` values of the row (qmax 127 for int8, 448
for e4m3), so every row uses its own full range.

Why one scale per token and head, not one per page and head (the work model decided):
- **Writes stay independent and in place.** Decode appends one token to a page per sequence per step. With a
  page scale, a new token whose ``max|x|`` exceeds the page's scale forces a read, requantization and rewrite
  of the whole page (``page_size`` rows per KV head, re-rounding every earlier token each time the scale
  grows), and a prefill chunk needs a segmented max over the tokens landing in each page before any write. A
  row scale is computed from the row alone: the write is the same one scatter as for float pages.
- **Bytes.** Per decode step the kernels read ``2 * head_dim`` bytes of values plus ``2 * 4`` bytes of scale per
  (token, KV head): +3.1% over the int8 values at head_dim 128, +6.3% at 64; the KV capacity is
  ``2 * head_dim * 2 / (2 * head_dim + 8)`` = 1.94x bfloat16 at head_dim 128 (1.88x at 64). A page scale saves
  those 3%, but its read-modify-write costs ``2 * page_size * 2 * head_dim`` bytes per sequence, layer and
  step, i.e. ``2 * page_size / kv_len`` of the attention read: 3.2% at 1,000 tokens with 16-token pages, more
  for shorter contexts or larger pages. So the two cost about the same bytes and the row scale is exact per row
  (an outlier token, such as the attention-sink first token, does not coarsen its neighbours' steps).
- **Layout.** The scales of one page are one contiguous row (a ``[..., 2, page_size]`` minor shape would be
  padded 32x in TPU tiles); a page's scales are one DMA or one gather row next to its values; tensor
  parallelism splits axis 1 by KV heads (heads are its major index), each shard's row padded on its own.
- **Lane-dense rows on TPU** (:func:`scale_row_width`). XLA:TPU stores an array whose minor dimension is
  narrower than the 128 lanes (``2 * num_kv_heads * page_size`` = 64 for two KV heads of 16-token pages)
  column-major, but the attention kernel DMAs rows, so every step relayouted every layer's whole scale
  array (written in one layout, copied to the other: the compiled-step audit of
  ``scripts/checks/check_tpu_compile.py`` finds such copies). On TPU the row is padded to a multiple of 128
  columns: the same HBM a row-major array of the narrow width takes in (8, 128) tiles, and counted in the
  engine's page budget (:func:`page_bytes`). Padding columns hold 1.0, are never written, and no reader
  uses them. Other platforms keep the exact width.

The kernels never dequantize a page in HBM: they load the quantized values (int8 and e4m3 values are exact in
bfloat16) and apply the scale in VMEM/registers, so HBM traffic is the quantized bytes plus the scales.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Names users pass as --kv-dtype for quantized pages, and the stored dtype.
KV_QUANT_DTYPES: dict[str, jnp.dtype] = {"int8": jnp.dtype(jnp.int8), "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn)}
SCALE_DTYPE = jnp.dtype(jnp.float32)


class QuantizedPages(NamedTuple):
    """One layer's quantized KV cache (see the module docstring for shapes and the scale index)."""

    pages: jax.Array  # [num_pages, num_kv_heads, page_size, 2 * head_dim] int8 / float8_e4m3fn
    scales: jax.Array  # [num_pages, num_kv_heads * 2 * page_size] float32


def is_quantized_dtype(dtype) -> bool:
    return jnp.dtype(dtype) in KV_QUANT_DTYPES.values()


def qmax(dtype) -> float:
    """Largest magnitude the stored dtype represents: 127 (int8, symmetric) or 448 (e4m3)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        return 127.0
    if dtype == jnp.float8_e4m3fn:
        return float(jnp.finfo(dtype).max)
    raise ValueError(f"not a quantized KV dtype: {dtype}")


LANES = 128  # a TPU vector register's lanes: the minor dimension of a lane-dense array is a multiple of it


def lane_dense(platform: str) -> bool:
    """Whether scale rows on ``platform`` are padded to whole lanes (module docstring): on TPU only."""
    return platform == "tpu"


def scale_row_width(num_kv_heads: int, page_size: int, dense: bool = False) -> int:
    """Columns of one page's scale row for ``num_kv_heads`` heads: ``2 * num_kv_heads * page_size``, rounded up
    to a multiple of :data:`LANES` when ``dense`` (TPU, :func:`lane_dense`)."""
    width = 2 * num_kv_heads * page_size
    return -(-width // LANES) * LANES if dense else width


def scales_shape(
    num_pages: int, num_kv_heads: int, page_size: int, dense: bool = False, shards: int = 1
) -> tuple[int, int]:
    """The scale array of ``num_pages`` pages of ``num_kv_heads`` heads; with tensor parallelism (``shards``
    chips splitting the heads) each chip's share of a row is padded on its own, so axis 1 splits evenly."""
    return (num_pages, shards * scale_row_width(num_kv_heads // shards, page_size, dense))


def page_bytes(num_kv_heads: int, page_size: int, head_dim: int, dtype, dense: bool = False) -> int:
    """HBM bytes of one page of one layer on one chip (``num_kv_heads``: that chip's heads): its values and,
    for quantized dtypes, its scale row (padded when ``dense``)."""
    dtype = jnp.dtype(dtype)
    values = num_kv_heads * page_size * 2 * head_dim * dtype.itemsize
    if not is_quantized_dtype(dtype):
        return values
    return values + scale_row_width(num_kv_heads, page_size, dense) * SCALE_DTYPE.itemsize


def bytes_per_token_head(head_dim: int, dtype) -> int:
    """HBM bytes of one token of one KV head (K and V, with their scales for quantized dtypes), unpadded:
    what the kernels read per key (padding columns of lane-dense rows are DMA'd whole rows, see
    :func:`page_bytes` for the stored size)."""
    dtype = jnp.dtype(dtype)
    extra = 2 * SCALE_DTYPE.itemsize if is_quantized_dtype(dtype) else 0
    return 2 * head_dim * dtype.itemsize + extra


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``x [..., head_dim]`` -> (values ``[..., head_dim]`` in ``dtype``, scales ``[...]`` float32), symmetric per
    row; an all-zero row gets scale 1 (its values are zeros either way)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / qmax(dtype), 1.0)
    y = x / scale[..., None]
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.clip(jnp.round(y), -127, 127)
    return y.astype(dtype), scale.astype(SCALE_DTYPE)


def allocate(
    num_pages: int,
    num_kv_heads: int,
    page_size: int,
    head_dim: int,
    dtype,
    device=None,
    scales_device=None,
    dense: bool = False,
    shards: int = 1,
) -> QuantizedPages:
    """Zero pages and unit scales for one layer (scales as :func:`scales_shape` of ``dense`` and ``shards``)."""
    from pallas_kernels.common import kv_pages_shape

    pages = jnp.zeros(kv_pages_shape(num_pages, num_kv_heads, page_size, head_dim), dtype, device=device)
    shape = scales_shape(num_pages, num_kv_heads, page_size, dense, shards)
    return QuantizedPages(pages, jnp.ones(shape, SCALE_DTYPE, device=scales_device))


def quantize_pages(pages: jax.Array, dtype, dense: bool = False) -> QuantizedPages:
    """Float ``[num_pages, num_kv_heads, page_size, 2 * head_dim]`` pages -> quantized pages (tests, benches),
    scale rows padded with 1.0 when ``dense``. NaN rows (poisoned slots) keep NaN scales for fp8 and garbage
    for int8; kernels must not read them."""
    num_pages, num_kv_heads, page_size, width = pages.shape
    d = width // 2
    rows = pages.reshape(num_pages, num_kv_heads, page_size, 2, d)
    values, scales = quantize(rows, dtype)  # [P, H, ps, 2, D], [P, H, ps, 2]
    scales = scales.transpose(0, 1, 3, 2).reshape(num_pages, 2 * num_kv_heads * page_size)
    pad = scale_row_width(num_kv_heads, page_size, dense) - scales.shape[1]
    scales = jnp.pad(scales, ((0, 0), (0, pad)), constant_values=1.0)
    return QuantizedPages(values.reshape(pages.shape), scales)


def dequantize_pages(qp: QuantizedPages) -> jax.Array:
    """Quantized pages -> float32 pages of the same layout (tests and the accuracy tools)."""
    num_pages, num_kv_heads, page_size, width = qp.pages.shape
    d = width // 2
    s = qp.scales[:, : 2 * num_kv_heads * page_size]  # without a lane-dense row's padding
    s = s.reshape(num_pages, num_kv_heads, 2, page_size).transpose(0, 1, 3, 2)  # [P, H, ps, 2]
    values = qp.pages.astype(jnp.float32).reshape(num_pages, num_kv_heads, page_size, 2, d)
    return (values * s[..., None]).reshape(num_pages, num_kv_heads, page_size, width)


def split(kv_cache) -> tuple[jax.Array, jax.Array | None]:
    """``(pages, scales)`` of a layer cache that is either a plain page array or :class:`QuantizedPages`."""
    if isinstance(kv_cache, QuantizedPages):
        return kv_cache.pages, kv_cache.scales
    return kv_cache, None


def validate_scales(kv_pages: jax.Array, kv_scales: jax.Array | None) -> None:
    """Quantized pages need float32 scales of the matching shape (exact or lane-dense rows, :func:`scales_shape`);
    float pages take none. ``ValueError`` otherwise."""
    num_pages, num_kv_heads, page_size, _ = kv_pages.shape
    if is_quantized_dtype(kv_pages.dtype):
        want = {scales_shape(num_pages, num_kv_heads, page_size, dense) for dense in (False, True)}
        if kv_scales is None or kv_scales.shape not in want or kv_scales.dtype != SCALE_DTYPE:
            got = None if kv_scales is None else (kv_scales.shape, kv_scales.dtype)
            raise ValueError(f"{kv_pages.dtype} pages need float32 scales of a shape in {sorted(want)}, got {got}")
    elif kv_scales is not None:
        raise ValueError(f"{kv_pages.dtype} pages take no scales")


def kv_dtype_from_name(name: str | None, model_dtype) -> np.dtype:
    """``--kv-dtype`` value (None: the model's dtype; int8, fp8_e4m3 or any float dtype name) -> stored dtype."""
    if name is None:
        return jnp.dtype(model_dtype)
    if name in KV_QUANT_DTYPES:
        return KV_QUANT_DTYPES[name]
    return jnp.dtype(name)
