"""Random ragged paged batches for tests and benchmarks, with the memory the kernels must not read poisoned.

:func:`make_case` builds a batch from ``(q_len, kv_len)`` pairs: pages in random order, every value
random (never zeros), and NaN in every place a correct kernel never reads: the null page 0, unused pages,
the slots of a sequence's last page past its ``kv_len``, and the queries of padding tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_quant
from pallas_kernels.common import cdiv, kv_pages_shape


@dataclasses.dataclass(frozen=True)
class PagedCase:
    q: jax.Array  # [num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array  # [num_pages, num_kv_heads, page_size, 2 * head_dim]
    kv_lens: jax.Array  # [max_seqs] int32
    block_tables: jax.Array  # [max_seqs, max_blocks] int32
    cu_q_lens: jax.Array  # [max_seqs + 1] int32
    num_seqs: jax.Array  # [1] int32
    k_dense: jax.Array  # [max_seqs, max_kv_len, num_kv_heads, head_dim], NaN past kv_len
    v_dense: jax.Array
    kv_scales: jax.Array | None = None  # [num_pages, num_kv_heads * 2 * page_size] f32 for quantized pages

    @property
    def kv(self):
        """The layer cache as the entry point takes it: the page array, or QuantizedPages."""
        if self.kv_scales is None:
            return self.kv_pages
        return kv_quant.QuantizedPages(self.kv_pages, self.kv_scales)

    @property
    def paged_args(self) -> tuple:
        return self.q, self.kv, self.kv_lens, self.block_tables, self.cu_q_lens, self.num_seqs

    @property
    def dense_args(self) -> tuple[jax.Array, ...]:
        return self.q, self.k_dense, self.v_dense, self.kv_lens, self.cu_q_lens, self.num_seqs


def make_case(
    seed: int,
    seqs: Sequence[tuple[int, int]],  # (q_len, kv_len) of each real sequence, q_len <= kv_len
    *,
    num_tokens: int,
    max_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype=jnp.float32,
    max_blocks: int | None = None,
    extra_pages: int = 3,
    poison: bool = True,
    kv_dtype=None,
) -> PagedCase:
    """A random ragged batch; padding sequences have ``q_len == kv_len == 0`` and tables full of page 0.

    ``kv_dtype`` int8 or float8_e4m3fn: the pages are quantized (:mod:`.kv_quant`), the scales of the poisoned
    slots are NaN, and ``k_dense``/``v_dense`` hold the dequantized values, so a kernel is compared with the
    reference on exactly what it stores (the quantization error itself is measured separately)."""
    rng = np.random.default_rng(seed)
    if len(seqs) > max_seqs or sum(q for q, _ in seqs) > num_tokens:
        raise ValueError("batch does not fit the bucket")
    if any(not 0 <= q <= kv for q, kv in seqs):
        raise ValueError(f"need 0 <= q_len <= kv_len, got {seqs}")
    needed = [cdiv(kv, page_size) for _, kv in seqs]
    max_blocks = max_blocks or max([1, *needed])
    num_pages = 1 + sum(needed) + extra_pages
    nan = np.nan if poison else 0.0
    pages = np.full(kv_pages_shape(num_pages, num_kv_heads, page_size, head_dim), nan, np.float32)
    order = rng.permutation(np.arange(1, num_pages))  # random physical page order
    tables = np.zeros((max_seqs, max_blocks), np.int32)
    max_kv = max([1, *(kv for _, kv in seqs)])
    k_dense = np.full((max_seqs, max_kv, num_kv_heads, head_dim), nan, np.float32)
    v_dense = np.full_like(k_dense, nan)
    kv_lens = np.zeros((max_seqs,), np.int32)
    cu = np.zeros((max_seqs + 1,), np.int32)
    used = 0
    for s, (q_len, kv_len) in enumerate(seqs):
        kv_lens[s] = kv_len
        cu[s + 1] = cu[s] + q_len
        k = rng.standard_normal((kv_len, num_kv_heads, head_dim), np.float32)
        v = rng.standard_normal((kv_len, num_kv_heads, head_dim), np.float32)
        k_dense[s, :kv_len], v_dense[s, :kv_len] = k, v
        for b in range(needed[s]):
            page = order[used]
            used += 1
            tables[s, b] = page
            n = min(page_size, kv_len - b * page_size)
            span = slice(b * page_size, b * page_size + n)
            pages[page, :, :n, :head_dim] = k[span].transpose(1, 0, 2)
            pages[page, :, :n, head_dim:] = v[span].transpose(1, 0, 2)
    cu[len(seqs) + 1 :] = cu[len(seqs)]
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim), np.float32)
    q[cu[len(seqs)] :] = nan
    as_dtype = lambda x: jnp.asarray(x, dtype)
    kv_pages, kv_scales = as_dtype(pages), None
    if kv_dtype is not None:
        kv_pages, kv_scales, k_dense, v_dense = _quantized(pages, tables, kv_lens, k_dense, v_dense, kv_dtype)
    return PagedCase(
        q=as_dtype(q),
        kv_pages=kv_pages,
        kv_scales=kv_scales,
        kv_lens=jnp.asarray(kv_lens),
        block_tables=jnp.asarray(tables),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([len(seqs)], jnp.int32),
        k_dense=as_dtype(k_dense),
        v_dense=as_dtype(v_dense),
    )


def _quantized(
    pages: np.ndarray, tables: np.ndarray, kv_lens: np.ndarray, k_dense: np.ndarray, v_dense: np.ndarray, kv_dtype
):
    """Quantizes float pages; NaN scales where the page is poisoned; dense K/V from the dequantized pages."""
    qp = kv_quant.quantize_pages(jnp.asarray(pages), kv_dtype)
    num_pages, num_kv_heads, page_size, width = pages.shape
    poisoned = np.isnan(pages[..., 0])  # [P, H, ps]
    poisoned = np.broadcast_to(poisoned[:, :, None, :], (num_pages, num_kv_heads, 2, page_size))
    scales = np.where(poisoned.reshape(qp.scales.shape), np.nan, np.asarray(qp.scales))
    deq = np.asarray(kv_quant.dequantize_pages(qp))
    k_dense, v_dense = k_dense.copy(), v_dense.copy()
    d = width // 2
    for s, kv_len in enumerate(kv_lens):
        for t in range(int(kv_len)):
            page = tables[s, t // page_size]
            k_dense[s, t] = deq[page, :, t % page_size, :d]
            v_dense[s, t] = deq[page, :, t % page_size, d:]
    return qp.pages, jnp.asarray(scales, jnp.float32), jnp.asarray(k_dense), jnp.asarray(v_dense)


def random_seqs(rng: np.random.Generator, num_tokens: int, max_seqs: int, max_kv: int) -> list[tuple[int, int]]:
    """A random mix of decode, chunked-prefill, full-prefill and empty sequences that fits the bucket."""
    seqs, budget = [], num_tokens
    for _ in range(int(rng.integers(1, max_seqs + 1))):
        kind = str(rng.choice(["decode", "chunk", "prefill", "empty"], p=[0.4, 0.25, 0.25, 0.1]))
        kv = int(rng.integers(1, max_kv + 1))
        q = {"decode": 1, "chunk": int(rng.integers(1, kv + 1)), "prefill": kv, "empty": 0}[kind]
        if kind == "empty" and rng.random() < 0.5:
            kv = 0
        if q > budget:
            q = kv = min(budget, 1)
        budget -= q
        seqs.append((q, kv))
    return seqs


def assert_close(out: jax.Array | np.ndarray, ref: jax.Array | np.ndarray, dtype) -> None:
    """float32 to about 1e-5, bfloat16 to about 1e-2, relative to the reference's scale; NaN fails."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out)), "kernel output has non-finite values"
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    scale = max(1.0, float(np.max(np.abs(ref))))
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * scale)


def check_case(case: PagedCase, backend: str | Callable[..., jax.Array], dtype=jnp.float32, **opts) -> None:
    """Runs ``backend`` (a backend name of ``ragged_paged_attention``, or a kernel taking the paged arguments
    and ``sm_scale`` plus ``opts``) on ``case`` and compares it with the dense reference (padding rows must be
    zeros)."""
    from pallas_kernels import dense_reference_attention, ragged_paged_attention

    sm_scale = opts.pop("sm_scale", case.q.shape[-1] ** -0.5)
    kernel = functools.partial(ragged_paged_attention, backend=backend) if isinstance(backend, str) else backend
    out = kernel(*case.paged_args, sm_scale=sm_scale, **opts)
    ref = dense_reference_attention(*case.dense_args, sm_scale=sm_scale, **opts)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, ref, dtype)
    pad_from = int(case.cu_q_lens[int(case.num_seqs[0])])
    assert not np.any(np.asarray(out[pad_from:], np.float32)), "padding rows must be zeros"


def cpu_kernel_path(isa: str) -> Callable[..., jax.Array]:
    """The C++ CPU kernel forced onto one instruction-set path (:data:`pallas_kernels.cpu.paged.ISA_FLAGS`), as a
    kernel :func:`check_case` takes (the paged arguments, quantized pages included, and the options)."""
    from pallas_kernels.cpu import paged as cpu_paged

    def run(q, kv, *rest, **opts):
        pages, scales = kv_quant.split(kv)
        return cpu_paged.cpu_ragged_paged_attention(q, pages, *rest, kv_scales=scales, isa=isa, **opts)

    return run


def median_seconds(fn: Callable[..., object], *args, iters: int) -> float:
    """Median wall time of ``fn(*args)`` in seconds over ``iters`` calls, after one compile-and-warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))
