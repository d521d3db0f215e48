"""Ragged paged attention on CPU as a C++ XLA FFI custom call (``cpu/paged_attention.cc``), built on first use.

Why: XLA:CPU cannot fuse the page gather into a dot, so :mod:`pallas_kernels.xla.paged` copies every page it reads
into a
contiguous chunk and its small per-(sequence, KV head) dots read that copy again; the C++ kernel walks each
sequence's pages through the block table and reads every page once, in place: decode as register tiles over
the pages, prefill as blocked matrix products (K/V widened once per block). It splits the work (sequence x KV
head x block of 32 query tokens, a long sequence's keys cut into parts when there are fewer items than
threads) over XLA's own intra-op thread pool. Same semantics and layout as every backend (:mod:`.common`);
float32 and bfloat16 pages of the query's dtype, and int8 / float8_e4m3fn pages with their scales
(:mod:`.kv_quant`, dequantized as the XLA path does: K scales on the scores, V scales on the probabilities).

Instruction set: one library per ISA path (``cpu/simd.h``): ``native`` (``-march=native``: AVX-512F, with
``vdpbf16ps`` for bfloat16 pages where the CPU has AVX-512 BF16; AVX2 on AVX2-only CPUs), ``avx2`` (the
AVX2 + FMA baseline, ``-march=haswell``) and ``generic`` (no vector ISA beyond the architecture's baseline).
``$PAGED_JAX_CPU_ISA`` picks the path the engine uses (default ``native``); tests build each.

Build: ``g++ -O3 -Wall -Wextra -Werror`` with the path's flags against the FFI headers jaxlib ships
(``jax.ffi.include_dir()``, included as system headers so their own warnings are not ours), into a cache
directory (``$PAGED_JAX_KERNEL_CACHE``, default ``~/.cache/paged-jax/kernels``) keyed by the sources, the
compiler, the flags, jaxlib and this CPU's instruction-set flags, so another machine or version never loads a
stale library. Without a C++ compiler (or if the build fails) :func:`available` is False, a warning says why
once, and ``backend="auto"`` uses the XLA path.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_quant

log = logging.getLogger(__name__)

# paged_attention.cc and its headers (the packed GEMM, gemm.cc, is its own library: pallas_kernels.cpu.gemm)
_HERE = Path(__file__).parent
SOURCES = tuple(sorted(f for f in _HERE.glob("*.[ch]*") if f.suffix in (".cc", ".h") and f.stem != "gemm"))
TARGET = "paged_jax_paged_attention"
# Warnings are errors: every path the tests build is warning-free (jaxlib's FFI headers are -isystem, theirs).
COMMON_FLAGS = ("-O3", "-ffp-contract=fast", "-fno-math-errno", "-std=c++20", "-shared", "-fPIC")
WARNING_FLAGS = ("-Wall", "-Wextra", "-Werror")
_X86 = platform.machine().lower() in ("x86_64", "amd64")
# Instruction-set paths and their target flags (the AVX2 baseline is Haswell's: AVX2, FMA, F16C, BMI2).
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "native": ("-march=native",),
    "avx2": ("-march=haswell",),
    "generic": ("-march=x86-64",) if _X86 else (),
}
ISA_ENV = "PAGED_JAX_CPU_ISA"
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One built and registered library: its FFI targets and the path it was compiled for."""

    target: str  # float pages
    quantized_target: str  # int8 / float8_e4m3fn pages with scales
    # A zeroed buffer mapped lazily (`zero_pages.h`, `pallas_kernels.cpu.zeros`); None in an older library.
    zeros_target: str | None
    isa: str  # what the library reports: "avx512+bf16", "avx512", "avx2" or "generic"
    library: Path


def default_isa() -> str:
    """The path the engine uses: ``$PAGED_JAX_CPU_ISA`` (default ``native``); ValueError names bad values."""
    isa = os.environ.get(ISA_ENV, "native")
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={isa!r}: expected one of {sorted(ISA_FLAGS)}")
    return isa


def flags(isa: str) -> tuple[str, ...]:
    return (*COMMON_FLAGS, *WARNING_FLAGS, *ISA_FLAGS[isa])


def cpu_flags() -> str:
    """This CPU's instruction-set flags (``-march=native`` builds for them; the executable store keys on them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def compiler() -> str | None:
    """The C++ compiler the kernels are built with (``$CXX``, else g++, c++ or clang++); None if there is none."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def library_path(
    compiler: str, isa: str = "native", name: str = "paged_attention", sources: tuple[Path, ...] | None = None
) -> Path:
    """Where library `name` (``name.cc`` among `sources`, default :data:`SOURCES`, which key it), built by
    `compiler` for path `isa` on this CPU and jaxlib, lives in the cache."""
    sources = SOURCES if sources is None else sources
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    parts = [f.read_text() for f in sources] + [version, " ".join(flags(isa)), jax.__version__, cpu_flags()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PAGED_JAX_KERNEL_CACHE", Path.home() / ".cache" / "paged-jax" / "kernels"))
    return cache / f"{name}-{isa}-{key}.so"


def build(
    compiler: str, isa: str = "native", name: str = "paged_attention", sources: tuple[Path, ...] | None = None
) -> Path:
    """Compiles library `name` (``name.cc`` among `sources`, default :data:`SOURCES`) for path `isa` unless the
    cache holds it; returns the library's path. Raises on a failed build."""
    sources = SOURCES if sources is None else sources
    out = library_path(compiler, isa, name, sources)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        lib = Path(tmp) / out.name
        source = sources[[f.name for f in sources].index(f"{name}.cc")]
        cmd = [compiler, *flags(isa), "-isystem", jax.ffi.include_dir(), str(source), "-o", str(lib)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(lib, out)  # atomic: concurrent builders (test workers, replicas) never see half a file
    log.info("built the CPU %s kernel (%s): %s", name, isa, out)
    return out


def isa_runs_here(isa: str) -> bool:
    """The avx2 path needs AVX2 and FMA; the others run wherever they are built."""
    if isa != "avx2":
        return True
    cpu = set(cpu_flags().split())
    return _X86 and {"avx2", "fma"} <= cpu


@functools.cache
def kernel(isa: str | None = None) -> Kernel | None:
    """The library of path `isa` (default :func:`default_isa`), built and registered with XLA:CPU at most once
    per process; None (after one warning) when it cannot be."""
    isa = isa or default_isa()
    if os.environ.get("PAGED_JAX_CPU_KERNEL", "1") == "0":
        return None
    cxx = compiler()
    if cxx is None:
        log.warning("no C++ compiler found (g++, c++, clang++ or $CXX): CPU attention uses the XLA path")
        return None
    if not isa_runs_here(isa):
        log.warning("this CPU lacks AVX2/FMA: the %s CPU kernel cannot run here; CPU attention uses the XLA path", isa)
        return None
    suffix = "" if isa == "native" else f"_{isa}"
    try:
        return load(build(cxx, isa), f"{TARGET}{suffix}")
    except Exception as e:  # a broken toolchain must not stop the engine: the XLA path is exact too
        log.warning("CPU paged-attention kernel unavailable (%s): CPU attention uses the XLA path", e)
        return None


def load(library: Path, target: str) -> Kernel:
    """Loads a built library (any build of these sources, e.g. a saved one from an older commit for an A/B) and
    registers its handlers with XLA:CPU as FFI targets `target`, `target` + ``_quantized`` and `target` +
    ``_zeros`` (a library built before `zero_pages.h` has no zeros target). Raises on failure."""
    lib = ctypes.cdll.LoadLibrary(str(library))
    zeros = f"{target}_zeros" if hasattr(lib, "ZeroPages") else None
    k = Kernel(target, f"{target}_quantized", zeros, _library_isa(lib), Path(library))
    jax.ffi.register_ffi_target(k.target, jax.ffi.pycapsule(lib.PagedAttention), platform="cpu")
    jax.ffi.register_ffi_target(k.quantized_target, jax.ffi.pycapsule(lib.PagedAttentionQuantized), platform="cpu")
    if zeros is not None:
        jax.ffi.register_ffi_target(zeros, jax.ffi.pycapsule(lib.ZeroPages), platform="cpu")
    return k


def _library_isa(lib: ctypes.CDLL) -> str:
    fn = lib.PagedAttentionIsa
    fn.restype = ctypes.c_char_p
    return fn().decode()


def available(isa: str | None = None) -> bool:
    """True once the kernel of path `isa` (default :func:`default_isa`) is built and registered."""
    return kernel(isa) is not None


def supports(q: jax.Array, kv_pages: jax.Array, kv_scales: jax.Array | None) -> bool:
    """Whether the kernel takes these operands: a float32 or bfloat16 query over pages of its own dtype, or over
    int8 / float8_e4m3fn pages with their scales in rows of the exact width."""
    if q.dtype not in DTYPES:
        return False
    if kv_scales is not None:  # exact scale rows only (lane-dense ones are TPU's)
        exact = kv_quant.scales_shape(kv_pages.shape[0], kv_pages.shape[1], kv_pages.shape[2])
        return kv_quant.is_quantized_dtype(kv_pages.dtype) and kv_scales.shape == exact
    return q.dtype == kv_pages.dtype


def cpu_ragged_paged_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, num_kv_heads, page_size, 2 * head_dim], q's dtype or int8 / e4m3
    kv_lens: jax.Array,  # [max_seqs] int32
    block_tables: jax.Array,  # [max_seqs, max_blocks_per_seq] int32
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    kv_scales: jax.Array | None = None,  # [num_pages, num_kv_heads * 2 * page_size] f32 for quantized pages
    isa: str | None = None,
) -> jax.Array:
    """Ragged paged attention by the C++ kernel of path `isa` (default :func:`default_isa`);
    ``[num_tokens, num_q_heads, head_dim]`` in ``q.dtype``. Call only when :func:`available` and :func:`supports`
    hold."""
    k = kernel(isa)
    if k is None:
        raise RuntimeError(f"the CPU kernel ({isa or default_isa()}) is not available on this machine")
    return call(
        k,
        q,
        kv_pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        kv_scales=kv_scales,
    )


def call(
    k: Kernel,
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    kv_scales: jax.Array | None = None,
) -> jax.Array:
    """:func:`cpu_ragged_paged_attention` by one loaded library `k` (:func:`kernel` or :func:`load`)."""
    attrs = dict(
        sm_scale=np.float32(sm_scale),
        soft_cap=np.float32(soft_cap or 0.0),
        sliding_window=np.int64(sliding_window or 0),
    )
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    if kv_scales is None:
        return jax.ffi.ffi_call(k.target, out)(q, kv_pages, kv_lens, block_tables, cu_q_lens, num_seqs, **attrs)
    quantized = jax.ffi.ffi_call(k.quantized_target, out)
    return quantized(q, kv_pages, kv_scales, kv_lens, block_tables, cu_q_lens, num_seqs, **attrs)
