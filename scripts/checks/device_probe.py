"""The page-id probe: paged-attention inputs whose every output element is known exactly, so a wrong page shows.

How it works. Every written slot's K and V rows are a +-1 pattern hashed from the slot's *physical* place in the
(stacked) cache: global page id, KV head and offset in the page (:func:`slot_pattern`). All queries are zero, so
every logit is 0, the softmax is uniform over the visible keys and the exact output of query token ``i`` of a
sequence is the mean of the V rows of its visible keys (``kv_len - q_len + i + 1`` keys, causal). Sums of +-1
are exact in float32, so the expected output (:func:`expected_output`) is exact and computed from the block
table and the hash alone, never from the page array: the check covers the engine's KV write
(:func:`pallas_kernels.write_kv`, through which the pages are filled) and the kernel's read together.

Everything a correct kernel must not read is NaN: unwritten pages (the null page 0 and every page the probe
does not use, i.e. almost all of a full-size stacked cache), the slots of a last page past ``kv_len`` (for
quantized pages their scales), and the queries of padding tokens; a read of any of them makes the output NaN.
A wrong page that holds finite data changes the mean: each case also computes the expected output of one
corrupted block-table entry (:func:`wrong_page_sensitivity`) and is only conclusive when that error is well
above the bound. ``--corrupt-table`` gives the kernel that corrupted table, so the probe is seen to fail.

Shapes: ``q [num_tokens, num_q_heads, head_dim]``, pages ``[num_layers * pages_per_layer, num_kv_heads,
page_size, 2 * head_dim]`` (:mod:`pallas_kernels.common`), block tables ``[max_seqs, max_blocks]`` of local
page ids of the probed layer, whose first page is ``page_offset`` in the stacked array.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels import kv_quant
from pallas_kernels.common import cdiv, kv_pages_shape

WRITE_CHUNK_TOKENS = 32768  # tokens per write_kv call while filling (bounds the [T, H, D] K/V temporaries)
SENSITIVITY_MARGIN = 4.0  # a case is conclusive when one wrong page moves an element this many bounds
_K_SALT, _V_SALT = 0x5BD1E995, 0x1B873593


@dataclasses.dataclass(frozen=True)
class ProbeShape:
    """One probe batch: the sequences, the bucket, the heads and the cache it lives in."""

    seqs: tuple[tuple[int, int], ...]  # (q_len, kv_len) of each real sequence, q_len <= kv_len
    num_tokens: int  # bucket tokens, >= sum of q_len (the rest are padding tokens)
    max_seqs: int  # bucket sequence slots, >= len(seqs)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    kv_dtype: str  # stored page dtype: bfloat16, float32, int8 or float8_e4m3fn
    q_dtype: str  # bfloat16 or float32
    num_layers: int = 1  # layers of the stacked cache; the probe lives in the last one
    pages_per_layer: int = 0  # 0: what the sequences need plus a few spare pages

    def blocks_needed(self) -> list[int]:
        return [cdiv(kv, self.page_size) for _, kv in self.seqs]

    def layer_pages(self) -> int:
        return self.pages_per_layer or 1 + sum(self.blocks_needed()) + 3

    def cache_elements(self) -> int:
        """Elements of the stacked value array (what 32-bit offsets would overflow)."""
        return self.num_layers * self.layer_pages() * self.num_kv_heads * self.page_size * 2 * self.head_dim

    def cache_bytes(self) -> int:
        pages = self.num_layers * self.layer_pages()
        per_page = kv_quant.page_bytes(self.num_kv_heads, self.page_size, self.head_dim, jnp.dtype(self.kv_dtype))
        return pages * per_page

    def describe(self) -> dict:
        q_lens = [q for q, _ in self.seqs]
        kv_lens = [kv for _, kv in self.seqs]
        return {
            "seqs": len(self.seqs),
            "q_tokens": sum(q_lens),
            "max_kv_len": max(kv_lens),
            "bucket": f"{self.num_tokens}x{self.max_seqs}",
            "heads": f"{self.num_q_heads}/{self.num_kv_heads}x{self.head_dim}",
            "page": self.page_size,
            "kv_dtype": self.kv_dtype,
            "q_dtype": self.q_dtype,
            "cache_elements": self.cache_elements(),
            "cache_gib": round(self.cache_bytes() / 2**30, 3),
        }


@dataclasses.dataclass(frozen=True)
class ProbeInputs:
    """A built probe: the kernel's arguments and the exact expected output."""

    q: jax.Array  # [num_tokens, num_q_heads, head_dim], zeros (NaN for padding tokens)
    kv: object  # stacked pages [L * P, H, ps, 2D], or kv_quant.QuantizedPages of that layout
    kv_lens: jax.Array  # [max_seqs] int32
    block_tables: jax.Array  # [max_seqs, max_blocks] int32, local page ids of the probed layer
    corrupted_tables: jax.Array  # the same with one entry pointing at another written page
    cu_q_lens: jax.Array  # [max_seqs + 1] int32
    num_seqs: jax.Array  # [1] int32
    page_offset: jax.Array  # int32 scalar: the probed layer's first page in the stacked array
    real_tokens: int


def slot_pattern(global_page: jax.Array, head: jax.Array, offset: jax.Array, salt: int, head_dim: int) -> jax.Array:
    """The +-1 float32 row ``[..., head_dim]`` of (global page, KV head, offset in page): a 32-bit hash per element,
    so two different slots (pages, heads or offsets) differ in about half their elements."""
    u = jnp.uint32
    x = (global_page.astype(u) * u(0x9E3779B1)) ^ (head.astype(u) * u(0x85EBCA77)) ^ (offset.astype(u) * u(0xC2B2AE3D))
    x = x[..., None] ^ (jnp.arange(head_dim, dtype=u) * u(0x27D4EB2F)) ^ u(salt)
    x = x ^ (x >> u(16))
    x = x * u(0x7FEB352D)
    x = x ^ (x >> u(15))
    x = x * u(0x846CA68B)
    x = x ^ (x >> u(16))
    return jnp.where((x & u(1)) == u(1), 1.0, -1.0).astype(jnp.float32)


def _empty_cache(shape: ProbeShape):
    """A stacked cache that is NaN everywhere (values for float pages, scales for quantized ones)."""
    dtype = jnp.dtype(shape.kv_dtype)
    pages_shape = kv_pages_shape(
        shape.num_layers * shape.layer_pages(), shape.num_kv_heads, shape.page_size, shape.head_dim
    )
    if not kv_quant.is_quantized_dtype(dtype):
        return jnp.full(pages_shape, jnp.nan, dtype)
    fill = jnp.nan if dtype == jnp.float8_e4m3fn else 0
    scales = kv_quant.scales_shape(pages_shape[0], shape.num_kv_heads, shape.page_size)
    return kv_quant.QuantizedPages(jnp.full(pages_shape, fill, dtype), jnp.full(scales, jnp.nan, jnp.float32))


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("head_dim",))
def _write_chunk(kv, slots: jax.Array, page_offset: jax.Array, *, head_dim: int):
    """Writes the probe rows of ``slots`` (``[C]`` int32 local slots, -1: padding) through the engine's write_kv."""
    pages, _ = kv_quant.split(kv)
    num_kv_heads, page_size = pages.shape[1], pages.shape[2]
    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :]
    global_page = (page_offset + slots // page_size)[:, None]
    offset = (slots % page_size)[:, None]
    k = slot_pattern(global_page, heads, offset, _K_SALT, head_dim)  # [C, H, D]
    v = slot_pattern(global_page, heads, offset, _V_SALT, head_dim)
    return pallas_kernels.write_kv(kv, k, v, slots, page_offset)


def build(shape: ProbeShape, seed: int = 0) -> ProbeInputs:
    """Allocates the NaN cache, writes every visible slot of the probe's sequences into pages taken in random
    order from the top of the last layer, and returns the kernel's arguments."""
    if len(shape.seqs) > shape.max_seqs or sum(q for q, _ in shape.seqs) > shape.num_tokens:
        raise ValueError(f"probe does not fit its bucket: {shape.describe()}")
    rng = np.random.default_rng(seed)
    needed = shape.blocks_needed()
    total, per_layer = sum(needed), shape.layer_pages()
    if total + 1 > per_layer:
        raise ValueError(f"pages_per_layer {per_layer} < {total + 1} pages the probe needs")
    top = np.arange(per_layer - total - min(3, per_layer - total - 1), per_layer)  # the layer's top pages
    pages = rng.permutation(top)[:total].astype(np.int32)
    max_blocks = max([1, *needed])
    tables = np.zeros((shape.max_seqs, max_blocks), np.int32)
    slots, used = [], 0
    for s, ((_, kv_len), n) in enumerate(zip(shape.seqs, needed, strict=True)):
        tables[s, :n] = pages[used : used + n]
        used += n
        t = np.arange(kv_len)
        slots.append(tables[s, t // shape.page_size] * shape.page_size + t % shape.page_size)
    corrupted = corrupt_table(tables, shape)
    kv_lens = np.zeros(shape.max_seqs, np.int32)
    cu = np.zeros(shape.max_seqs + 1, np.int32)
    for s, (q_len, kv_len) in enumerate(shape.seqs):
        kv_lens[s] = kv_len
        cu[s + 1] = cu[s] + q_len
    cu[len(shape.seqs) + 1 :] = cu[len(shape.seqs)]
    real = int(cu[len(shape.seqs)])

    kv = _empty_cache(shape)
    page_offset = pallas_kernels.stacked_page_offset(kv, shape.num_layers - 1, shape.num_layers)
    flat = np.concatenate(slots).astype(np.int32)
    for start in range(0, len(flat), WRITE_CHUNK_TOKENS):
        chunk = np.full(WRITE_CHUNK_TOKENS, -1, np.int32)
        part = flat[start : start + WRITE_CHUNK_TOKENS]
        chunk[: len(part)] = part
        kv = _write_chunk(kv, jnp.asarray(chunk), page_offset, head_dim=shape.head_dim)
    q = jnp.zeros((shape.num_tokens, shape.num_q_heads, shape.head_dim), shape.q_dtype)
    q = q.at[real:].set(jnp.nan)
    return ProbeInputs(
        q=q,
        kv=kv,
        kv_lens=jnp.asarray(kv_lens),
        block_tables=jnp.asarray(tables),
        corrupted_tables=jnp.asarray(corrupted),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([len(shape.seqs)], jnp.int32),
        page_offset=page_offset,
        real_tokens=real,
    )


def corrupt_table(tables: np.ndarray, shape: ProbeShape) -> np.ndarray:
    """The block tables with one entry of the longest sequence (its middle full block) replaced by another
    written page (of another sequence, or of its own next block): the reads stay finite, the mean moves."""
    needed = shape.blocks_needed()
    s = int(np.argmax(needed))
    b = max(0, needed[s] // 2 - 1) if needed[s] > 1 else 0
    others = [(o, j) for o in range(len(needed)) if o != s for j in range(needed[o])]
    src = others[0] if others else (s, (b + 1) % needed[s])
    out = tables.copy()
    out[s, b] = tables[src]
    if out[s, b] == tables[s, b]:
        raise ValueError(f"cannot corrupt a probe of one single-page sequence: {shape.describe()}")
    return out


@functools.partial(jax.jit, static_argnames=("page_size", "head_dim", "num_kv_heads", "group", "num_tokens"))
def expected_output(
    tables: jax.Array,  # [max_seqs, max_blocks] int32 local page ids
    kv_lens: jax.Array,  # [max_seqs] int32
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32
    num_seqs: jax.Array,  # [1] int32
    page_offset: jax.Array,  # int32 scalar
    *,
    page_size: int,
    head_dim: int,
    num_kv_heads: int,
    group: int,  # query heads per KV head
    num_tokens: int,
) -> jax.Array:
    """The exact output ``[num_tokens, num_kv_heads * group, head_dim]`` float32 of the probe (padding rows 0):
    the running mean of the V patterns the table names, from the hash (integer sums, exact in float32)."""
    max_seqs, max_blocks = tables.shape
    keys = jnp.arange(max_blocks * page_size, dtype=jnp.int32)
    gp = page_offset + tables[:, keys // page_size]  # [S, L]
    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)
    v = slot_pattern(gp[:, :, None], heads[None, None, :], (keys % page_size)[None, :, None], _V_SALT, head_dim)
    v = jnp.where((keys[None, :] < kv_lens[:, None])[:, :, None, None], v, 0.0)  # [S, L, H, D]
    csum = jnp.cumsum(v, axis=1)
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right").astype(jnp.int32) - 1, 0, max_seqs - 1)
    real = tok < cu_q_lens[num_seqs[0]]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = jnp.clip(kv_lens[seq] - q_len + tok - cu_q_lens[seq], 0, max_blocks * page_size - 1)
    out = csum[seq, pos] / (pos + 1).astype(jnp.float32)[:, None, None]  # [T, H, D]
    out = jnp.where(real[:, None, None], out, 0.0)
    return jnp.repeat(out, group, axis=1)


@dataclasses.dataclass(frozen=True)
class Judgment:
    """A kernel output judged against the exact expected output.

    Each element may differ by ``rel * |expected| + abs * rms(expected)`` (:func:`tolerance`): bfloat16 rounding
    is relative to each element, and the floor is relative to the output's root mean square. ``score`` is the
    largest error in units of that bound (pass: <= 1); ``wrong_page_score`` the same of the output one corrupted
    block-table entry gives (conclusive: >= ``SENSITIVITY_MARGIN``)."""

    passed: bool
    score: float
    wrong_page_score: float
    err_rel_rms: float  # max |out - expected| / rms(expected) over real rows
    tol_rel: float
    tol_abs_rms: float
    finite: bool
    padding_zero: bool
    reason: str

    def fields(self) -> dict:
        return dataclasses.asdict(self)


def tolerance(q_dtype: str) -> tuple[float, float]:
    """``(rel, abs)`` of the per-element bound. bfloat16 outputs: the output's rounding and, for quantized pages,
    the V scale rounded to bfloat16 before the PV dot (2^-9 relative each), with a 2x margin; the sums of +-1
    are exact. float32 outputs: exact up to the final division."""
    return (2.0**-7, 2.0**-10) if jnp.dtype(q_dtype) == jnp.bfloat16 else (2.0**-20, 2.0**-20)


def judge(out, expected, wrong, real_tokens: int, q_dtype: str) -> Judgment:
    """Pass iff the output is finite, padding rows are zeros, every element is within the bound and the probe
    is conclusive (one wrong page moves some element by more than ``SENSITIVITY_MARGIN`` bounds)."""
    out = np.asarray(jax.device_get(out), np.float32)
    expected = np.asarray(jax.device_get(expected), np.float32)
    wrong = np.asarray(jax.device_get(wrong), np.float32)
    rel, abs_ = tolerance(q_dtype)
    exp = expected[:real_tokens]
    rms = float(np.sqrt(np.mean(np.square(exp, dtype=np.float64))))
    bound = rel * np.abs(exp) + abs_ * rms
    finite = bool(np.all(np.isfinite(out)))
    padding_zero = bool(not np.any(out[real_tokens:]))
    diff = np.abs(out[:real_tokens] - exp)
    score = float(np.max(diff / bound)) if finite else float("inf")
    err = float(np.max(diff)) / rms if finite else float("inf")
    sens = float(np.max(np.abs(wrong[:real_tokens] - exp) / bound))
    reasons = []
    if not finite:
        reasons.append("non-finite output (a NaN slot was read)")
    if not padding_zero:
        reasons.append("padding rows not zero")
    if not score <= 1.0:
        reasons.append(f"error {score:.3g} x the bound ({err:.3g} x rms)")
    if not sens >= SENSITIVITY_MARGIN:
        reasons.append(f"inconclusive: one wrong page moves the output only {sens:.3g} x the bound")
    return Judgment(not reasons, score, sens, err, rel, abs_, finite, padding_zero, "; ".join(reasons) or "exact")


def run_probe(shape: ProbeShape, backend: str, corrupt: bool = False, seed: int = 0) -> dict:
    """Builds the probe, runs ``pallas_kernels.ragged_paged_attention`` on ``backend`` over the stacked cache
    (with the layer's page offset, as the engine's scanned step calls it) and judges the output."""
    inputs = build(shape, seed)
    tables = inputs.corrupted_tables if corrupt else inputs.block_tables
    out = pallas_kernels.ragged_paged_attention(
        inputs.q,
        inputs.kv,
        inputs.kv_lens,
        tables,
        inputs.cu_q_lens,
        inputs.num_seqs,
        inputs.page_offset,
        sm_scale=shape.head_dim**-0.5,
        backend=backend,
    )
    exp = expected_for(shape, inputs, inputs.block_tables)
    wrong = expected_for(shape, inputs, inputs.corrupted_tables)
    verdict = judge(out, exp, wrong, inputs.real_tokens, shape.q_dtype)
    return {**verdict.fields(), **({"corrupted_table": True} if corrupt else {})}


def expected_for(shape: ProbeShape, inputs: ProbeInputs, tables: jax.Array) -> jax.Array:
    """:func:`expected_output` of a built probe read through ``tables`` (its own, or the corrupted ones)."""
    return expected_output(
        tables,
        inputs.kv_lens,
        inputs.cu_q_lens,
        inputs.num_seqs,
        inputs.page_offset,
        page_size=shape.page_size,
        head_dim=shape.head_dim,
        num_kv_heads=shape.num_kv_heads,
        group=shape.num_q_heads // shape.num_kv_heads,
        num_tokens=shape.num_tokens,
    )
