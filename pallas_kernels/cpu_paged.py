"""Ragged paged attention on CPU as a C++ XLA FFI custom call (``cpu/paged_attention.cc``), built on first use.

Why: XLA:CPU cannot fuse the page gather into a dot, so :mod:`.xla_paged` copies every page it reads into a
contiguous chunk and its small per-(sequence, KV head) dots read that copy again; the C++ kernel walks each
sequence's pages through the block table and folds every page into an online softmax while it is in L1, so KV
is read once, in place. It splits the work (sequence x KV head x block of 32 query tokens) over XLA's own
intra-op thread pool. Same semantics and layout as every backend (:mod:`.common`); float32 and bfloat16 pages
(quantized pages stay on the XLA path).

Build: ``g++ -O3 -march=native`` against the FFI headers jaxlib ships (``jax.ffi.include_dir()``), into a
cache directory (``$PAGED_JAX_KERNEL_CACHE``, default ``~/.cache/paged-jax/kernels``) keyed by the source,
the compiler, jaxlib and this CPU's instruction-set flags, so another machine or version never loads a stale
library. Without a C++ compiler (or if the build fails) :func:`available` is False, a warning says why once,
and ``backend="auto"`` uses the XLA path.
"""

from __future__ import annotations

import ctypes
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

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu" / "paged_attention.cc"
TARGET = "paged_jax_paged_attention"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _cpu_flags() -> str:
    """This CPU's instruction-set flags (``-march=native`` builds for them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def library_path(compiler: str) -> Path:
    """Where this source, built by `compiler` for this CPU and jaxlib, lives in the cache."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), version, " ".join(FLAGS), jax.__version__, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("PAGED_JAX_KERNEL_CACHE", Path.home() / ".cache" / "paged-jax" / "kernels"))
    return cache / f"paged_attention-{key}.so"


def build(compiler: str) -> Path:
    """Compiles the kernel unless the cache holds it; returns the library's path. Raises on a failed build."""
    out = library_path(compiler)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        lib = Path(tmp) / out.name
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(lib)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(lib, out)  # atomic: concurrent builders (test workers, replicas) never see half a file
    log.info("built the CPU paged-attention kernel: %s", out)
    return out


@functools.cache
def available() -> bool:
    """True once the kernel is built and registered with XLA:CPU (built at most once per process)."""
    if os.environ.get("PAGED_JAX_CPU_KERNEL", "1") == "0":
        return False
    compiler = _compiler()
    if compiler is None:
        log.warning("no C++ compiler found (g++, c++, clang++ or $CXX): CPU attention uses the XLA path")
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(build(compiler)))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.PagedAttention), platform="cpu")
    except Exception as e:  # a broken toolchain must not stop the engine: the XLA path is exact too
        log.warning("CPU paged-attention kernel unavailable (%s): CPU attention uses the XLA path", e)
        return False
    return True


def supports(q: jax.Array, kv_pages: jax.Array, kv_scales: jax.Array | None) -> bool:
    """Whether the kernel takes these operands: float32 or bfloat16 pages of q's own dtype, not quantized."""
    return kv_scales is None and q.dtype == kv_pages.dtype and q.dtype in DTYPES


def cpu_ragged_paged_attention(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, num_kv_heads, page_size, 2 * head_dim], q's dtype
    kv_lens: jax.Array,  # [max_seqs] int32
    block_tables: jax.Array,  # [max_seqs, max_blocks_per_seq] int32
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Ragged paged attention by the C++ kernel; ``[num_tokens, num_q_heads, head_dim]`` in ``q.dtype``.
    Call only when :func:`available` and :func:`supports` hold."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q,
        kv_pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        sm_scale=np.float32(sm_scale),
        soft_cap=np.float32(soft_cap or 0.0),
        sliding_window=np.int64(sliding_window or 0),
    )
