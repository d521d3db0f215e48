"""Where does a warm start find its executables without lowering them again?

JAX's persistent compilation cache keys an entry by the lowered StableHLO, so even a process whose every
executable is in that cache traces and lowers each one to find it (most of a warm start's time on CPU). The
executable store keys an entry by what determines the executable instead, known before anything is traced:

- the job's key (`paged_jax.worker.compile_jobs.Job`): the function's kind, the runner's configuration (model
  config, attention backend and CPU kernel library, mesh, quantization, LoRA shape, scan, buckets, the
  parameters' and pages' shapes, dtypes and shardings) and the job's static shape, flags and XLA compiler
  options, as its `repr` (every part is a plain value);
- this process's environment (`environment`): jax and jaxlib versions, the backend's platform and version,
  the devices' kinds and count, the CPU's instruction-set flags, `XLA_FLAGS` and the `PAGED_JAX_*`
  variables that change compiled code, the JAX options that change lowering, and a hash of every source file
  of `paged_jax` and `pallas_kernels` (a code change invalidates every entry: a stale executable is never
  run, at the price of one cold start after each change).

An entry is the executable serialized by `jax.experimental.serialize_executable` with its argument and result
trees, written atomically (a reader never sees half a file). Loading it skips tracing, lowering and XLA.
Any failure to load (a corrupt or truncated file, an executable XLA refuses, as XLA:CPU does on hosts whose
CPU features differ from the writer's) is counted, logged once per process, and the job is compiled as if
the entry were absent (and the entry rewritten). Entries are pickles: the store trusts its directory as
JAX's cache does (the user's own cache directory). A load marks its entry used (its modification time);
the first write of a process deletes the entries no process has used for `UNUSED_DAYS` (those of older
sources and versions, which no key can name again).

The store sits beside JAX's persistent cache, which stays on: after a code change that leaves an
executable's HLO as it was, the store misses but JAX's cache still serves the compile.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import jax
from jax.experimental import serialize_executable

import pallas_kernels
from pallas_kernels.cpu.paged import cpu_flags

log = logging.getLogger(__name__)

FORMAT = 1  # the entry layout below; part of every key
# Environment variables that change what is compiled (XLA's flags, the CPU kernel's path, oneDNN dots).
ENV_VARS = ("XLA_FLAGS", "PAGED_JAX_CPU_ISA", "PAGED_JAX_CPU_KERNEL", "PAGED_JAX_ONEDNN", "LIBTPU_INIT_ARGS")
# JAX options that change how a function lowers.
JAX_OPTIONS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_numpy_rank_promotion",
    "jax_threefry_partitionable",
)
UNUSED_DAYS = 14
_SOURCE_SUFFIXES = (".py", ".cc", ".h", ".hpp", ".txtpb")


def source_files() -> list[tuple[str, Path]]:
    """(name relative to the packages' parent, path) of every source file of `paged_jax` and `pallas_kernels`."""
    files = []
    for root in (Path(__file__).resolve().parents[1], Path(pallas_kernels.__file__).resolve().parent):
        for path in root.rglob("*"):
            if path.suffix in _SOURCE_SUFFIXES and "__pycache__" not in path.parts:
                files.append((path.relative_to(root.parent).as_posix(), path))
    return sorted(files)


@functools.cache
def source_hash() -> str:
    """A hash of every source file of `paged_jax` and `pallas_kernels` (names and contents)."""
    h = hashlib.sha256()
    for name, path in source_files():
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def environment() -> str:
    """Everything of this process, outside a job's key, that changes a compiled executable (module docstring)."""
    import jaxlib

    backend = jax.devices()[0].client
    parts = {
        "format": FORMAT,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": backend.platform,
        "platform_version": backend.platform_version,
        "devices": sorted({d.device_kind for d in jax.devices()}),
        "device_count": jax.device_count(),
        "cpu_flags": cpu_flags(),
        "env": {k: os.environ.get(k) for k in ENV_VARS},
        "jax_options": {k: str(getattr(jax.config, k, None)) for k in JAX_OPTIONS},
        "sources": source_hash(),
    }
    return repr(parts)


@dataclass(slots=True)
class StoreStats:
    """What the store did in this process (all runners)."""

    loads: int = 0  # executables loaded
    load_seconds: float = 0.0  # reading and deserializing them (summed over threads)
    misses: int = 0  # jobs with no entry (compiled, then written)
    rejected: int = 0  # entries found but not loadable (compiled again, then rewritten)
    writes: int = 0
    write_failures: int = 0


@functools.cache
def open_store(directory: str) -> ExecutableStore:
    """The process's one store of `directory` (every runner using it shares its counts)."""
    return ExecutableStore(directory)


class ExecutableStore:
    """Serialized executables in `directory`, one file per job key (see the module docstring); thread-safe."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._pruned = False

    def digest(self, key: object) -> str:
        """The entry name of the job with this key in this process's environment."""
        return hashlib.sha256((environment() + "\0" + repr(key)).encode()).hexdigest()

    def path(self, key: object) -> Path:
        return self.directory / f"{self.digest(key)}.exe"

    def load(self, key: object) -> jax.stages.Compiled | None:
        """The stored executable of `key`, or None (absent, or not loadable: counted and logged once)."""
        path = self.path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            with self._lock:
                self.stats.misses += 1
            return None
        try:
            stored_key, serialized, in_tree, out_tree = pickle.loads(blob)
            if stored_key != repr(key):
                raise ValueError("the entry holds another job (a hash collision or a foreign file)")
            compiled = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree)
        except Exception as e:  # noqa: BLE001 - any failure to load means compiling; it is counted and logged
            self._reject(path, e)
            return None
        try:
            os.utime(path)  # used: kept by `_prune`
        except OSError:
            pass
        return compiled

    def count_load(self, seconds: float) -> None:
        """Record one executable loaded by a caller of `load` in `seconds`."""
        with self._lock:
            self.stats.loads += 1
            self.stats.load_seconds += seconds

    def save(self, key: object, compiled: jax.stages.Compiled) -> None:
        """Write `compiled` as `key`'s entry (atomically); a failure is logged once and otherwise ignored."""
        path = self.path(key)
        self._prune()
        try:
            serialized, in_tree, out_tree = serialize_executable.serialize(compiled)
            blob = pickle.dumps((repr(key), serialized, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(blob)
            os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 - the store is an optimization: the executable is still used
            with self._lock:
                self.stats.write_failures += 1
            why = (
                " (XLA:CPU cannot serialize oneDNN fusions: bfloat16 forward steps on AMX hosts)"
                if "onednn" in str(e)
                else ""
            )
            self._warn_once(
                "write",
                "could not write an executable to the store %s (%s: %s); the next process compiles it again%s",
                self.directory,
                type(e).__name__,
                e,
                why,
            )
            return
        with self._lock:
            self.stats.writes += 1

    def _prune(self) -> None:
        """Once per process: delete entries unused for `UNUSED_DAYS`."""
        with self._lock:
            if self._pruned:
                return
            self._pruned = True
        cutoff = time.time() - UNUSED_DAYS * 86400
        for entry in self.directory.glob("*.exe"):
            try:
                if entry.stat().st_mtime < cutoff:
                    entry.unlink()
            except OSError:
                pass  # another process pruned it first

    def _reject(self, path: Path, error: Exception) -> None:
        with self._lock:
            self.stats.rejected += 1
        self._warn_once(
            "load",
            "the executable store holds an entry that could not be loaded, so it is compiled again (%s: %s: %s); "
            "if every run says this, the store is useless on this host: PAGED_JAX_COMPILE_CACHE=off",
            path,
            type(error).__name__,
            error,
        )

    def _warn_once(self, kind: str, message: str, *args: object) -> None:
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            log.warning(message, *args)
