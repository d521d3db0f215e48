"""The packed-weight CPU GEMM (pallas_kernels.cpu.gemm): every ISA path against jnp.dot at HIGHEST on random
inputs (rows 1-512, K and N off the panel and pair boundaries, float32 and bfloat16, bfloat16 in with float32
out), the int8 product against the exact integer dot (and XLA's), its panel layouts, and the clear errors of
operands it does not take."""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cpu import gemm
from pallas_kernels.cpu import paged as cpu_paged

pytestmark = pytest.mark.skipif(not gemm.available(), reason="the CPU GEMM needs a C++ compiler (g++)")

PATHS = [
    pytest.param(isa, marks=pytest.mark.skipif(not gemm.available(isa), reason=f"no {isa} path here"))
    for isa in cpu_paged.ISA_FLAGS
]
# (rows, K, N): a decode row, tiles short of MR, a K block boundary crossed (the float32 block is 128 or 256 k),
# odd K (bfloat16's pad pair), N short of a panel and past one, many rows (a prefill chunk).
SHAPES = [(1, 64, 32), (5, 33, 70), (13, 300, 129), (32, 512, 96), (37, 1027, 40), (512, 96, 48)]


def _reference(x, w):
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_highest_precision_dot(isa, shape, dtype):
    rows, k, n = shape
    rng = np.random.default_rng(rows * 1000 + k + n)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)), dtype)
    kern = gemm.kernel(isa)
    packed = gemm.pack(w, kern.nr)
    assert gemm.supports(x, packed, isa)
    ref = np.asarray(_reference(x, w))
    tol = 1e-6 * np.sqrt(k) * np.abs(ref).max()  # float32 accumulation in another order
    y = np.asarray(jax.jit(lambda x, p: gemm.matmul(x, p, isa))(x, packed))
    assert y.shape == (rows, n) and y.dtype == jnp.dtype(dtype)
    if dtype == jnp.float32:
        np.testing.assert_allclose(y, ref, rtol=0, atol=tol)
    else:  # one rounding to bfloat16 of the float32 sum: within half a bfloat16 ulp of it, plus the order's slack
        y32 = np.asarray(gemm.matmul(x, packed, isa, out_dtype=jnp.float32))
        np.testing.assert_allclose(y32, ref, rtol=0, atol=tol)
        np.testing.assert_allclose(y.astype(np.float32), ref, rtol=2.0**-8, atol=tol)
        np.testing.assert_array_equal(y, y32.astype(jnp.bfloat16))


@pytest.mark.parametrize("isa", PATHS)
def test_leading_axes_and_nonfinite_inputs_stay_in_their_rows(isa):
    """x [..., K] keeps its leading axes; a NaN in one row of x makes only that row NaN (no value leaks across
    rows or from the zero padding of the last panel)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 40)).astype(np.float32)
    x[1, 2, 7] = np.nan
    w = jnp.asarray(rng.standard_normal((40, 50)), jnp.float32)
    y = np.asarray(gemm.matmul(jnp.asarray(x), gemm.pack(w, gemm.kernel(isa).nr), isa))
    assert y.shape == (3, 4, 50)
    assert np.isnan(y[1, 2]).all() and np.isfinite(np.delete(y.reshape(12, 50), 6, axis=0)).all()


def test_each_path_has_two_vectors_per_panel():
    flags = set(cpu_paged.cpu_flags().split())
    native = gemm.kernel("native")
    assert native.isa == cpu_paged.kernel("native").isa  # one ISA rule for both libraries
    assert native.nr == (32 if "avx512f" in flags else 16 if {"avx2", "fma"} <= flags else 8)
    assert gemm.kernel("generic").nr == 8 and gemm.kernel("generic").isa == "generic"
    if gemm.available("avx2"):
        assert gemm.kernel("avx2").nr == 16


def test_panel_layout():
    """float32: panel p is columns [p*nr, p*nr + nr) as a [K, nr] block; bfloat16: k-pairs interleaved per column;
    zeros past N and in the odd K's pad row."""
    w = np.arange(5 * 7, dtype=np.float32).reshape(5, 7)
    p = np.asarray(gemm.pack(w, 4).packed)
    assert p.shape == (2, 5, 4)
    np.testing.assert_array_equal(p[1, :, :3], w[:, 4:])
    np.testing.assert_array_equal(p[1, :, 3], 0)
    b = np.asarray(gemm.pack(jnp.asarray(w, jnp.bfloat16), 4).packed).astype(np.float32)
    assert b.shape == (2, 3, 4, 2)
    np.testing.assert_array_equal(b[0, 1, 2], [w[2, 2], w[3, 2]])
    np.testing.assert_array_equal(b[0, 2, :, 1], 0)  # K = 5: the last pair's second row is padding
    np.testing.assert_array_equal(b[1, :, 3], 0)


def test_operands_it_does_not_take():
    kern = gemm.kernel()
    w = gemm.pack(np.ones((8, 8), np.float32), kern.nr)
    assert not gemm.supports(jnp.ones((2, 8), jnp.bfloat16), w)  # dtype differs from the packed weight's
    assert not gemm.supports(jnp.ones((2, 9), jnp.float32), w)  # K differs
    assert not gemm.supports(jnp.ones((2, 8), jnp.float32), gemm.pack(np.ones((8, 8), np.float32), kern.nr * 2))
    with pytest.raises(ValueError, match="float32, bfloat16 or int8"):
        gemm.pack(np.ones((4, 4), np.float16), kern.nr)
    with pytest.raises(ValueError, match=r"\[K, N\]"):
        gemm.pack(np.ones((4, 4, 4), np.float32), kern.nr)
    bad = gemm.PackedWeight(w.packed.astype(jnp.bfloat16), w.k, w.n, w.nr)  # a float32 layout called as bfloat16
    with pytest.raises(Exception, match="packed must be"):
        gemm.matmul(jnp.ones((2, 8), jnp.bfloat16), bad).block_until_ready()


def test_gemm_and_attention_libraries_have_their_own_cache_keys():
    cxx = cpu_paged.compiler()
    assert gemm.kernel().library != cpu_paged.kernel().library
    assert cpu_paged.library_path(cxx, "native") != cpu_paged.library_path(cxx, "native", gemm.NAME, gemm.SOURCES)
    assert not any(f.stem == "gemm" for f in cpu_paged.SOURCES)  # editing the GEMM never rebuilds attention


@pytest.mark.parametrize("isa", PATHS)
def test_read_stream_reads_every_float(isa):
    """The roofline's read loop (`PackedGemmReadLoop`, behind `gemm.read_gbs_per_core`) sums every float it is
    given once, so the bytes it is timed over are the bytes it read."""
    kern = gemm.kernel(isa)
    lib = ctypes.cdll.LoadLibrary(str(kern.library))
    lib.PackedGemmReadLoop.restype = ctypes.c_float
    lib.PackedGemmReadLoop.argtypes = (ctypes.c_void_p, ctypes.c_int64)
    x = (np.arange(6 * 2 * kern.nr) % 7).astype(np.float32)  # small integers: the sum is exact in any order
    assert lib.PackedGemmReadLoop(x.ctypes.data, x.size) == float(x.sum())
    assert lib.PackedGemmReadLoop(x.ctypes.data, 2 * kern.nr) == float(x[: 2 * kern.nr].sum())
    assert gemm.read_gbs_per_core(threads=2, mib=1, rounds=1, isa=isa) > 0


# (rows, K, N) for int8: K off the quad boundary (1027, 33), a K block crossed (the int8 block is 512 k on
# AVX-512), tiles short of MR8 (4 or 12 rows), N off a panel.
INT8_SHAPES = [(1, 64, 32), (5, 33, 70), (13, 1027, 129), (32, 512, 96), (100, 96, 48)]


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("shape", INT8_SHAPES)
def test_int8_is_the_exact_integer_dot(isa, shape):
    """int8 x int8 -> int32 equals the integer sum exactly (numpy int64) and XLA's int32 dot, bit for bit, over
    the whole int8 range (-128 included: the offset x + 128 spans 0..255)."""
    rows, k, n = shape
    rng = np.random.default_rng(rows * 1000 + k + n)
    x = rng.integers(-128, 128, (rows, k), dtype=np.int8)
    w = rng.integers(-128, 128, (k, n), dtype=np.int8)
    packed = gemm.pack(w, gemm.kernel(isa).nr)
    assert gemm.supports(jnp.asarray(x), packed, isa)
    y = np.asarray(jax.jit(lambda x, p: gemm.matmul(x, p, isa))(jnp.asarray(x), packed))
    assert y.dtype == np.int32 and y.shape == (rows, n)
    np.testing.assert_array_equal(y, x.astype(np.int64) @ w.astype(np.int64))
    xla = jax.lax.dot(jnp.asarray(x), jnp.asarray(w), preferred_element_type=jnp.int32)
    np.testing.assert_array_equal(y, np.asarray(xla))


@pytest.mark.parametrize("isa", PATHS)
def test_int8_extremes_do_not_overflow(isa):
    """The largest offset sums (x = -128 -> 0 and x = 127 -> 255 against w = -128 and 127) at a long K stay
    exact: 4099 * 255 * 128 is far inside int32, and the compensation takes the offset back off."""
    k = 4099
    x = np.stack([np.full(k, 127, np.int8), np.full(k, -128, np.int8), np.full(k, -127, np.int8)])
    w = np.stack([np.full(k, -128, np.int8), np.full(k, 127, np.int8), np.zeros(k, np.int8)], axis=1)
    y = np.asarray(gemm.matmul(jnp.asarray(x), gemm.pack(w, gemm.kernel(isa).nr), isa))
    np.testing.assert_array_equal(y, x.astype(np.int64) @ w.astype(np.int64))


def test_int8_panel_layout_and_compensation():
    """int8: k-quads interleaved per column, zeros past N and in K's pad rows; comp[n] = 128 * sum_k w[k, n]."""
    w = (np.arange(6 * 7) % 251 - 125).astype(np.int8).reshape(6, 7)
    p = gemm.pack(w, 4)
    q = np.asarray(p.packed)
    assert q.shape == (2, 2, 4, 4) and q.dtype == np.int8
    np.testing.assert_array_equal(q[0, 0, 2], w[0:4, 2])
    np.testing.assert_array_equal(q[1, 1, 1, :2], w[4:6, 5])
    np.testing.assert_array_equal(q[1, 1, 1, 2:], 0)
    np.testing.assert_array_equal(q[1, :, 3], 0)  # column 7 is past N
    comp = np.asarray(p.comp)
    assert comp.shape == (8,) and comp.dtype == np.int32
    np.testing.assert_array_equal(comp[:7], 128 * w.astype(np.int64).sum(0))
    assert comp[7] == 0
    assert gemm.packed_shape(6, 7, 4, jnp.int8) == q.shape


def test_int8_operands_it_does_not_take():
    kern = gemm.kernel()
    w = gemm.pack(np.ones((8, 8), np.int8), kern.nr)
    with pytest.raises(ValueError, match="x must be int8"):
        gemm.matmul(jnp.ones((2, 8), jnp.float32), w)
    with pytest.raises(ValueError, match="result int32"):
        gemm.matmul(jnp.ones((2, 8), jnp.int8), w, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="at most 65536"):
        gemm.pack(np.zeros((gemm.MAX_INT8_K + 4, 1), np.int8), kern.nr)
    assert not gemm.supports(jnp.ones((2, 8), jnp.float32), w)
    bad = gemm.PackedWeight(w.packed, w.k, w.n, w.nr, w.comp[:-1])  # a compensation of the wrong length
    with pytest.raises(Exception, match="comp must be"):
        gemm.matmul(jnp.ones((2, 8), jnp.int8), bad).block_until_ready()


def test_native_int8_uses_vnni_where_the_cpu_has_it():
    flags = set(cpu_paged.cpu_flags().split())
    assert gemm.kernel("native").vnni == ({"avx512_vnni", "avx512bw"} <= flags)
    assert not gemm.kernel("generic").vnni
