"""STREAM-style memory bandwidth of this machine: the yardstick for the CPU attention kernel's GB/s.

Four loops over float32 arrays far larger than the caches, each on 1 and on all threads (std::thread, the
arrays split in contiguous slices): ``read`` (a sum, bytes read), ``copy`` (b = a), ``scale`` (b = s a) and
``triad`` (a = b + s c), counted the STREAM way (bytes read + bytes written). Best of ``--reps`` runs, since
other processes only ever slow a run down. The C++ is compiled with ``-O3 -march=native`` on first use.

    python scripts/bench/bench_bandwidth.py [--mib 512] [--reps 5] [--threads N]

:func:`stream` is what ``scripts/bench/bench_kernels.py`` prints beside the kernel's own GB/s.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <time.h>

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

static double thread_cpu() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// Wall seconds of fn over [0, n) cut into `threads` slices; *cpu = the threads' CPU seconds, summed.
template <typename Fn>
static double timed(int threads, int64_t n, const Fn& fn, double* cpu) {
  std::vector<double> cpus(threads);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([=, &fn, &cpus] {
      const double c0 = thread_cpu();
      fn(n * t / threads, n * (t + 1) / threads);
      cpus[t] = thread_cpu() - c0;
    });
  }
  for (auto& th : pool) th.join();
  *cpu = 0;
  for (double c : cpus) *cpu += c;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// op 0 read, 1 copy, 2 scale, 3 triad; returns wall seconds, *cpu CPU seconds; *sink keeps the read loop alive.
extern "C" double stream_op(int op, int threads, float* a, float* b, float* c, int64_t n, double* cpu, double* sink) {
  const float s = 3.0f;
  std::vector<double> sums(threads > 0 ? threads : 1);
  double t = timed(threads, n, [&](int64_t lo, int64_t hi) {
    if (op == 0) {
      float acc[16] = {};
      for (int64_t i = lo; i + 16 <= hi; i += 16)
        for (int k = 0; k < 16; ++k) acc[k] += a[i + k];
      double tot = 0;
      for (float x : acc) tot += x;
      sums[lo * threads / (n ? n : 1)] = tot;
    } else if (op == 1) {
      for (int64_t i = lo; i < hi; ++i) b[i] = a[i];
    } else if (op == 2) {
      for (int64_t i = lo; i < hi; ++i) b[i] = s * a[i];
    } else {
      for (int64_t i = lo; i < hi; ++i) a[i] = b[i] + s * c[i];
    }
  }, cpu);
  double tot = 0;
  for (double x : sums) tot += x;
  *sink = tot;
  return t;
}
"""

OPS = {"read": (0, 1), "copy": (1, 2), "scale": (2, 2), "triad": (3, 3)}  # name: (op, arrays touched)


@functools.cache
def _library() -> ctypes.CDLL:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("bench_bandwidth needs a C++ compiler (g++)")
    tmp = Path(tempfile.mkdtemp(prefix="paged-jax-stream-"))
    src, lib = tmp / "stream.cc", tmp / "stream.so"
    src.write_text(SOURCE)
    subprocess.run(
        [compiler, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread", str(src), "-o", str(lib)],
        check=True,
    )
    so = ctypes.cdll.LoadLibrary(str(lib))
    so.stream_op.restype = ctypes.c_double
    f32p = ctypes.POINTER(ctypes.c_float)
    f64p = ctypes.POINTER(ctypes.c_double)
    so.stream_op.argtypes = [ctypes.c_int, ctypes.c_int, f32p, f32p, f32p, ctypes.c_int64, f64p, f64p]
    return so


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    """GB/s of one loop: by wall time, and per CPU-second of each thread (``bytes / (cpu_seconds / threads)``:
    what the threads move while they run, which other processes on shared cores change far less)."""

    wall: float
    cpu: float


def stream(threads: int, mib: int = 512, reps: int = 5) -> dict[str, Bandwidth]:
    """Each loop's bandwidth on `threads` threads over arrays of `mib` MiB each (best of `reps`)."""
    import numpy as np

    n = mib * 1024 * 1024 // 4
    arrays = [np.full(n, 1.0 + i, np.float32) for i in range(3)]  # touched: the pages exist before timing
    ptrs = [x.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) for x in arrays]
    sink, cpu = ctypes.c_double(), ctypes.c_double()
    lib = _library()
    out = {}
    for name, (op, touched) in OPS.items():
        walls, cpus = [], []
        for _ in range(reps):
            walls.append(lib.stream_op(op, threads, *ptrs, n, ctypes.byref(cpu), ctypes.byref(sink)))
            cpus.append(cpu.value / threads)
        gb = touched * n * 4 / 1e9
        out[name] = Bandwidth(gb / min(walls), gb / min(cpus))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="MiB per array")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    print(
        f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs, arrays of {args.mib} MiB, best of {args.reps}"
    )
    print(f"{'threads':>8s} " + " ".join(f"{k:>14s}" for k in OPS) + "   GB/s wall / per CPU-second")
    for threads in sorted({1, args.threads}):
        r = stream(threads, args.mib, args.reps)
        print(f"{threads:8d} " + " ".join(f"{r[k].wall:6.1f} / {r[k].cpu:5.1f}" for k in OPS))


if __name__ == "__main__":
    main()
