"""A packed-weight GEMM on CPU as a C++ XLA FFI custom call (``cpu/gemm.cc``), built on first use.

Why: XLA:CPU's dot libraries receive a weight in its stored ``[K, N]`` layout on every call, so they either
repack it each time (and, for bfloat16, re-interleave it into k-pairs) or read it with strided panel loads. Here a
weight is packed once (:func:`pack`, at load) into column panels of ``NR`` columns, each a contiguous ``[K, NR]``
block (bfloat16: k-pairs interleaved per column, the ``vdpbf16ps`` operand), and :func:`matmul` reads each weight
byte once per call, sequentially, with register tiles of rows over a K block that stays in L1. Columns (panels)
are split over XLA's intra-op threads as the attention kernel splits its work items (``cpu/parallel.h``).

int8 (the ``w8a8`` scheme, `paged_jax.model.quantized_weight`): an int8 weight is packed with its k-quads
interleaved per column (``vpdpbusd``'s signed operand) and a per-column compensation ``128 * sum_k w[k, n]``;
:func:`matmul` of int8 activations gives the exact int32 products (the activations enter as ``x + 128``, unsigned,
and the compensation comes off), by AVX-512 VNNI where the path has it, else by int16 pair products.

Instruction-set paths, build and cache are the attention kernel's (:mod:`pallas_kernels.cpu.paged`):
``native``, ``avx2``, ``generic``, ``$PAGED_JAX_CPU_ISA``; ``NR`` is two vectors of the path (32 columns on
AVX-512, 16 on AVX2, 8 generic), so a packed weight belongs to the path it was packed for
(:attr:`PackedWeight.nr`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import statistics
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu import paged

log = logging.getLogger(__name__)

NAME = "gemm"
HERE = Path(__file__).parent
SOURCES = tuple(HERE / f for f in ("gemm.cc", "parallel.h", "simd.h"))
TARGET = "paged_jax_packed_gemm"
INT8_TARGET = "paged_jax_packed_gemm_int8"
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # the float kinds (x, weight and out share one)
INT8 = jnp.dtype(jnp.int8)  # the integer kind: int8 x int8 -> int32
MAX_INT8_K = 65536  # the int8 product's longest K (no int32 sum of the offset products can overflow)


@dataclasses.dataclass(frozen=True)
class GemmKernel:
    """One built and registered GEMM library: its FFI target, panel width and the path it was compiled for."""

    target: str
    int8_target: str
    nr: int  # columns per packed panel
    isa: str  # "avx512+bf16", "avx512", "avx2" or "generic"
    vnni: bool  # the int8 product multiplies with AVX-512 VNNI (else int16 pairs)
    library: Path


@functools.partial(jax.tree_util.register_dataclass, data_fields=["packed", "comp"], meta_fields=["k", "n", "nr"])
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A ``[K, N]`` weight in the GEMM's panel layout: float32 ``[ceil(N/nr), K, nr]``, bfloat16
    ``[ceil(N/nr), ceil(K/2), nr, 2]``, int8 ``[ceil(N/nr), ceil(K/4), nr, 4]`` (columns past N and the pad rows
    of K are zeros). `comp` (int8 only, int32 ``[ceil(N/nr) * nr]``): ``128 * sum_k w[k, n]``, what the offset
    activations add to column n."""

    packed: jax.Array
    k: int
    n: int
    nr: int
    comp: jax.Array | None = None

    @property
    def dtype(self) -> jnp.dtype:
        return self.packed.dtype


@functools.cache
def kernel(isa: str | None = None) -> GemmKernel | None:
    """The GEMM library of path `isa` (default ``$PAGED_JAX_CPU_ISA``), built and registered with XLA:CPU at most
    once per process; None (after one warning) when it cannot be (no compiler, a failed build, a path this CPU
    cannot run, or ``PAGED_JAX_CPU_GEMM=0``)."""
    isa = isa or paged.default_isa()
    if os.environ.get("PAGED_JAX_CPU_GEMM", "1") == "0":
        return None
    cxx = paged.compiler()
    if cxx is None or not paged.isa_runs_here(isa):
        log.warning("the %s CPU GEMM cannot be built or run here: CPU weight dots stay XLA's", isa)
        return None
    try:
        lib_path = paged.build(cxx, isa, NAME, SOURCES)
        return load(lib_path, "" if isa == "native" else f"_{isa}")
    except Exception as e:  # a broken toolchain must not stop the engine: XLA's dots are exact too
        log.warning("CPU GEMM unavailable (%s): CPU weight dots stay XLA's", e)
        return None


def load(library: Path, suffix: str = "") -> GemmKernel:
    """Loads a built GEMM library and registers its two handlers with XLA:CPU as FFI targets
    :data:`TARGET` and :data:`INT8_TARGET` followed by `suffix`."""
    lib = ctypes.cdll.LoadLibrary(str(library))
    lib.PackedGemmIsa.restype = ctypes.c_char_p
    lib.PackedGemmPanelWidth.restype = ctypes.c_int64
    lib.PackedGemmHasVnni.restype = ctypes.c_int32
    target, int8_target = TARGET + suffix, INT8_TARGET + suffix
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.PackedGemm), platform="cpu")
    jax.ffi.register_ffi_target(int8_target, jax.ffi.pycapsule(lib.PackedGemmInt8), platform="cpu")
    return GemmKernel(
        target,
        int8_target,
        int(lib.PackedGemmPanelWidth()),
        lib.PackedGemmIsa().decode(),
        bool(lib.PackedGemmHasVnni()),
        Path(library),
    )


def available(isa: str | None = None) -> bool:
    return kernel(isa) is not None


def _group(dtype) -> int:
    """The k rows one panel row interleaves: float32 1, bfloat16 2 (pairs), int8 4 (quads)."""
    return 4 // jnp.dtype(dtype).itemsize


def pack(w, nr: int) -> PackedWeight:
    """``w [K, N]`` (float32, bfloat16 or int8, any array) in the panel layout of width `nr`, on the host (numpy:
    no XLA program per weight shape); the result holds device arrays (w's dtype, and int8's int32 `comp`)."""
    a = np.asarray(w)
    if a.ndim != 2:
        raise ValueError(f"pack: weight must be [K, N], got shape {a.shape}")
    dtype = jnp.dtype(a.dtype)
    if dtype not in DTYPES and dtype != INT8:
        raise ValueError(f"pack: weight dtype must be float32, bfloat16 or int8, got {a.dtype}")
    k, n = a.shape
    if dtype == INT8 and k > MAX_INT8_K:
        raise ValueError(f"pack: an int8 weight's K must be at most {MAX_INT8_K}, got {k}")
    panels, g = -(-n // nr), _group(dtype)
    kp = -(-k // g) * g
    buf = np.zeros((kp, panels * nr), a.dtype)
    buf[:k, :n] = a
    out = buf.reshape(kp, panels, nr).transpose(1, 0, 2) if g == 1 else buf.reshape(kp // g, g, panels, nr)
    if g > 1:
        out = out.transpose(2, 0, 3, 1)
    comp = None
    if dtype == INT8:
        comp = jnp.asarray((128 * buf.sum(axis=0, dtype=np.int64)).astype(np.int32))
    return PackedWeight(jnp.asarray(np.ascontiguousarray(out)), k, n, nr, comp)


def packed_shape(k: int, n: int, nr: int, dtype) -> tuple[int, ...]:
    """The shape :func:`pack` gives a ``[k, n]`` weight of `dtype` for panels of `nr`."""
    panels, g = -(-n // nr), _group(dtype)
    return (panels, k, nr) if g == 1 else (panels, -(-k // g), nr, g)


def supports(x: jax.Array, w: PackedWeight, isa: str | None = None) -> bool:
    """Whether the GEMM of path `isa` takes ``x [..., K]`` against `w`: the library exists, w was packed for its
    panel width, and x has w's dtype (float32, bfloat16 or int8) and contraction length."""
    k = kernel(isa)
    return k is not None and k.nr == w.nr and x.dtype == w.dtype and x.shape[-1] == w.k


def matmul(x: jax.Array, w: PackedWeight, isa: str | None = None, out_dtype=None) -> jax.Array:
    """``x [..., K] . w [K, N] -> [..., N]`` by the GEMM of path `isa`. Float kinds: in `out_dtype` (x's dtype or
    float32; default x's), accumulated in float32. int8 x against an int8 w: the exact int32 sums (`out_dtype`
    must be None or int32). Call only where :func:`supports` holds."""
    k = kernel(isa)
    if k is None or k.nr != w.nr:
        raise RuntimeError(f"the CPU GEMM ({isa or paged.default_isa()}) for panels of {w.nr} is not available")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)
    if w.dtype == INT8:
        if x.dtype != INT8 or (out_dtype is not None and jnp.dtype(out_dtype) != jnp.int32):
            raise ValueError(f"int8 GEMM: x must be int8 and the result int32, got {x.dtype} -> {out_dtype}")
        xu = jax.lax.bitcast_convert_type(x2, jnp.uint8) ^ np.uint8(0x80)  # x + 128: vpdpbusd's unsigned operand
        out = jax.ffi.ffi_call(k.int8_target, jax.ShapeDtypeStruct((x2.shape[0], w.n), jnp.int32))(
            xu, w.packed, w.comp, n=np.int64(w.n)
        )
    else:
        out = jax.ffi.ffi_call(k.target, jax.ShapeDtypeStruct((x2.shape[0], w.n), out_dtype or x.dtype))(
            x2, w.packed, n=np.int64(w.n)
        )
    return out.reshape(*lead, w.n)


def _loaded(isa: str | None) -> tuple[GemmKernel, ctypes.CDLL]:
    """The path's built kernel and its shared library opened through ctypes (the measurement loops' entry points)."""
    k = kernel(isa)
    if k is None:
        raise RuntimeError(f"the CPU GEMM ({isa or paged.default_isa()}) is not available")
    return k, ctypes.cdll.LoadLibrary(str(k.library))


def peak_gflops_per_core(
    isa: str | None = None, bfloat16: bool = False, seconds: float = 0.2, int8: bool = False
) -> float:
    """The path's multiply-add peak on one core, measured: a register-only FMA loop (``vdpbf16ps`` for
    `bfloat16` where the path has it; `int8`: the int8 product's ``vpdpbusd`` or int16-pair loop, in giga integer
    operations), timed by this thread's CPU time (so other load on the machine does not lower it), best of three."""
    _, lib = _loaded(isa)
    lib.PackedGemmPeakLoop.restype = lib.PackedGemmPeakLoopInt8.restype = ctypes.c_double
    lib.PackedGemmPeakLoop.argtypes = (ctypes.c_int64, ctypes.c_int32)
    lib.PackedGemmPeakLoopInt8.argtypes = (ctypes.c_int64,)

    def loop(iters: int) -> float:
        return lib.PackedGemmPeakLoopInt8(iters) if int8 else lib.PackedGemmPeakLoop(iters, int(bfloat16))

    iters, best = 1 << 16, 0.0
    while True:
        t = time.thread_time()
        loop(iters)
        if time.thread_time() - t >= seconds / 3:
            break
        iters *= 4
    for _ in range(3):
        t = time.thread_time()
        ops = loop(iters)
        best = max(best, ops / max(time.thread_time() - t, 1e-9))
    return best / 1e9


def read_gbs_per_core(threads: int | None = None, mib: int = 256, rounds: int = 3, isa: str | None = None) -> float:
    """The memory side of the roofline: GB of a sequential read stream per CPU-second on one core while `threads`
    cores (default all) stream at once, each its own `mib` MiB buffer (larger than the caches, as a step's weights
    are), timed by each thread's CPU time; the median over threads and `rounds`. A dot of `rows` rows does
    ``2 * rows / itemsize`` FLOP per weight byte, so it cannot exceed ``this * 2 * rows / itemsize`` GFLOP per
    CPU-second when its weight streams from memory."""
    k, lib = _loaded(isa)
    lib.PackedGemmReadLoop.restype = ctypes.c_float
    lib.PackedGemmReadLoop.argtypes = (ctypes.c_void_p, ctypes.c_int64)
    threads = threads or os.cpu_count() or 1
    n = mib * 2**20 // 4 // (2 * k.nr) * (2 * k.nr)
    bufs = [np.ones(n, np.float32) for _ in range(threads)]
    start = threading.Barrier(threads)
    rates: list[float] = []

    def stream(buf: np.ndarray) -> None:  # ctypes releases the GIL: the threads read at the same time
        for _ in range(rounds):
            start.wait()
            t = time.thread_time()
            lib.PackedGemmReadLoop(buf.ctypes.data, n)
            rates.append(n * 4 / max(time.thread_time() - t, 1e-9) / 1e9)

    workers = [threading.Thread(target=stream, args=(b,)) for b in bufs]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return statistics.median(rates)
