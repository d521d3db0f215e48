"""Which step executables exist, who compiles them, and what did compiling cost?

A runner's device work is a few jitted functions (the forward step, the sampler) each compiled for a small
set of static shapes. `Executables` holds the compiled form of each (function, shape key) pair, ahead of time
(`jit(...).lower(...).compile()`), so that:

- warm-up compiles many shapes at once on a thread pool, each thread lowering and compiling whole jobs (XLA
  compiles release the GIL; lowering all jobs on one thread and only compiling on the pool measured 2x
  slower on this 2-core machine);
- a shape needed after warm-up is compiled once, counted and logged naming the shape: as a warning when the
  warm-up missed it, as info when the warm-up left it to its first use on purpose (the Python API's rarer
  sampler variants, for example), with a progress bar on stderr while the step waits where asked;
- a shape being compiled in the background is waited for, never compiled twice; one the background has not
  started yet is compiled by the step that needs it at once, never queued behind the rest of the warm-up;
- every compile is timed and, through JAX's monitoring events, attributed to the persistent compilation
  cache (a hit: loaded from disk) or not (a miss: compiled by XLA);
- with an executable store (`paged_jax.worker.executable_store`) a job is first looked up there by its key,
  with no tracing or lowering, and what is compiled is written there for the next process.

Executables are shared by every runner of a process whose functions and static shapes agree (tests build
many engines of one config), so the registry is keyed by the caller's full key; counting is per runner
(`CompileStats`), passed into each call.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import jax
from tqdm.auto import tqdm

from paged_jax.worker.executable_store import ExecutableStore

log = logging.getLogger(__name__)

# XLA compiler options of one executable, as sorted (name, value) pairs (`paged_jax.worker.xla_flags`).
CompilerOptions = tuple[tuple[str, object], ...]

_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_CACHE_MISS = "/jax/compilation_cache/cache_misses"  # recorded when a newly compiled executable is written
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # every XLA compile or cache load
# JAX's warning when an entry exists but cannot be loaded (corrupt, or refused by XLA, as XLA:CPU does on some
# hosts whose CPU features differ from the writer's); it then compiles again, which would otherwise look like a miss.
_REJECTED = "Error reading persistent compilation cache entry"


@dataclass(slots=True)
class CompileStats:
    """Compilations one runner asked for (a shape already compiled in this process costs nothing and is not
    counted). `seconds` is summed over threads, so with parallel warm-up it can exceed the wall time."""

    count: int = 0  # executables lowered and compiled (or loaded from JAX's persistent cache after lowering)
    seconds: float = 0.0  # lowering plus compiling (or looking up and loading)
    lower_seconds: float = 0.0  # of `seconds`, tracing and lowering to StableHLO (paid on a cache hit too)
    cache_hits: int = 0  # of `count`, loaded from the persistent compilation cache
    after_warmup: int = 0  # of `count` and `loaded`, needed by a step after warm-up (each logged as a warning)
    loaded: int = 0  # executables loaded from the executable store (neither lowered nor compiled)
    load_seconds: float = 0.0  # looking them up and loading them (failed lookups included)

    def as_dict(self) -> dict[str, float]:
        return {
            "compile_count": self.count,
            "compile_seconds": self.seconds,
            "compile_lower_seconds": self.lower_seconds,
            "compile_cache_hits": self.cache_hits,
            "compiles_after_warmup": self.after_warmup,
            "executables_loaded": self.loaded,
            "executable_load_seconds": self.load_seconds,
        }


class _ProcessCounters:
    """JAX's compile events, counted per thread (to attribute them to one compile) and for the process."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.lock = threading.Lock()
        self.hits = self.misses = self.backend_compiles = self.rejected = 0
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def on_warning(self, message: Warning | str) -> None:
        """Count (and log once) a persistent-cache entry JAX could not load; see `watch_cache_rejections`."""
        if not str(message).startswith(_REJECTED):
            return
        with self.lock:
            self.rejected += 1
            first = self.rejected == 1
        if first:
            log.warning(
                "the persistent compile cache holds an entry XLA could not load, so it is compiled again (%s); "
                "if every run says this, the cache is useless on this host: PAGED_JAX_COMPILE_CACHE=off",
                message,
            )

    def _on_event(self, event: str, **_) -> None:
        if event == _CACHE_HIT:
            self.local.hits = getattr(self.local, "hits", 0) + 1
            with self.lock:
                self.hits += 1
        elif event == _CACHE_MISS:
            with self.lock:
                self.misses += 1

    def _on_duration(self, event: str, duration_secs: float, **_) -> None:
        if event == _BACKEND_COMPILE:
            with self.lock:
                self.backend_compiles += 1

    def thread_hits(self) -> int:
        return getattr(self.local, "hits", 0)


PROCESS = _ProcessCounters()


def persistent_cache_summary() -> dict[str, int]:
    """Process-wide: XLA compiles requested (cache loads included), persistent cache hits and misses written,
    `compiled`: executables XLA actually built (requests that were not hits), and `rejected`: entries found in
    the cache that could not be loaded (each one compiled again)."""
    with PROCESS.lock:
        return {
            "requests": PROCESS.backend_compiles,
            "hits": PROCESS.hits,
            "misses": PROCESS.misses,
            "compiled": PROCESS.backend_compiles - PROCESS.hits,
            "rejected": PROCESS.rejected,
        }


def watch_cache_rejections() -> None:
    """Route JAX's warnings through `PROCESS.on_warning` before they are shown (the warnings module has no
    listener API; `showwarning` is called for every warning the filters let through, from any thread)."""
    shown = warnings.showwarning
    if getattr(shown, "paged_jax_watch", False):
        return

    def showwarning(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
        PROCESS.on_warning(message)
        shown(message, category, filename, lineno, file, line)

    showwarning.paged_jax_watch = True  # type: ignore[attr-defined]  # our marker: a function has no such attribute
    warnings.showwarning = showwarning


def enable_persistent_cache(cache_dir: str) -> None:
    """Keep every executable in `cache_dir` ("off": none), so a second process with the same shapes compiles
    nothing: no minimum compile time (the step's small executables cost more to build than to load)."""
    if cache_dir == "off":
        return
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    watch_cache_rejections()
    log.info("persistent compile cache: %s (PAGED_JAX_COMPILE_CACHE=off to disable)", cache_dir)


class Executables:
    """Compiled variants of jitted functions, keyed by a hashable shape key; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[Hashable, jax.stages.Compiled] = {}
        self._pending: dict[Hashable, concurrent.futures.Future] = {}
        self.version = 0  # changes whenever an executable is added or dropped (readers cache on it)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._done

    def __len__(self) -> int:
        return len(self._done)

    def clear(self) -> None:
        """Drop every finished executable (a compile in flight still completes and is kept). A runner that
        needs a dropped shape again compiles it again, counted as any compile is."""
        with self._lock:
            self._done.clear()
            self.version += 1

    def get(
        self,
        key: Hashable,
        lower: Callable[[], jax.stages.Lowered],
        stats: CompileStats,
        warm: bool = False,
        describe: str = "",
        options: CompilerOptions = (),
        store: ExecutableStore | None = None,
        deferred: bool = False,
        show: bool = False,
    ) -> jax.stages.Compiled:
        """The executable for `key`, compiled now if needed (`lower()` gives its lowering, `options` the XLA
        compiler options; `key` must tell option sets apart). `warm`: warm-up is over, so a compile here stalls
        a step: counted in `after_warmup` and logged with `describe` (the shape), as a warning unless
        `deferred` (the warm-up left this shape to its first use on purpose: logged as info); `show`: a
        progress bar on stderr names the shape while the step waits. `store`: looked up first, written after
        a compile (`key`'s repr must then name everything the executable depends on)."""
        compiled = self._done.get(key)
        if compiled is not None:
            return compiled
        future, owner = self._claim(key)
        if owner:
            bar = None
            if warm:
                stats.after_warmup += 1
                if deferred:
                    log.info("compiling %s on its first use", describe or key)
                else:
                    log.warning(
                        "compiling a new step shape after warm-up: %s (the step waits; warm-up missed it)",
                        describe or key,
                    )
                if show:
                    bar = tqdm(total=1, desc=f"compiling {describe or key}", unit="shape", leave=False)
            try:
                self._compile(key, lower, stats, future, options, store)
            finally:
                if bar is not None:
                    bar.update(1)
                    bar.close()
        return future.result()

    def compile_all(
        self,
        jobs: Iterable[
            tuple[Hashable, Callable[[], jax.stages.Lowered]]
            | tuple[Hashable, Callable[[], jax.stages.Lowered], CompilerOptions]
        ],
        stats: CompileStats,
        workers: int,
        progress: Callable[[Hashable], None] | None = None,
        cancel: threading.Event | None = None,
        store: ExecutableStore | None = None,
        assist: Callable[[], None] | None = None,
    ) -> list[Hashable]:
        """Compile every job (key, lower[, compiler options]) not yet compiled on `workers` threads, in order;
        `progress(key)` after each. Returns the keys this call compiled. A job is claimed only when a thread
        starts it, so a step that needs a shape the warm-up has not reached compiles it at once itself (it never
        waits behind the warm-up's queue) and the warm-up then waits for that compile instead of repeating it.
        Once `cancel` is set no new compile starts (the running ones finish). `store`: as in `get`. `assist`:
        runs on a thread before each of its jobs (the compile worker's queue first,
        `paged_jax.worker.compile_worker.CompileWorker.assist`)."""

        def run(key: Hashable, lower: Callable[[], jax.stages.Lowered], options: CompilerOptions):
            if cancel is not None and cancel.is_set():
                return None, False
            if assist is not None:
                assist()
            future, owner = self._claim(key)
            if owner:
                self._compile(key, lower, stats, future, options, store)
            return future, owner

        mine = []
        with concurrent.futures.ThreadPoolExecutor(max(1, workers), thread_name_prefix="compile") as pool:
            started = [(key, pool.submit(run, key, lower, rest[0] if rest else ())) for key, lower, *rest in jobs]
            for key, started_job in started:
                future, owner = started_job.result()
                if future is None:  # cancelled before it started
                    continue
                future.result()
                if owner:
                    mine.append(key)
                if progress is not None:
                    progress(key)
        return mine

    def _claim(self, key: Hashable) -> tuple[concurrent.futures.Future, bool]:
        """The future of `key`'s compile and whether the caller must run it (no one else is)."""
        with self._lock:
            if key in self._done:
                future: concurrent.futures.Future = concurrent.futures.Future()
                future.set_result(self._done[key])
                return future, False
            if key in self._pending:
                return self._pending[key], False
            future = self._pending[key] = concurrent.futures.Future()
            return future, True

    def _fail(self, key: Hashable, future: concurrent.futures.Future, error: BaseException) -> None:
        with self._lock:
            del self._pending[key]
        future.set_exception(error)

    def _compile(
        self,
        key: Hashable,
        lower: Callable[[], jax.stages.Lowered],
        stats: CompileStats,
        future: concurrent.futures.Future,
        options: CompilerOptions = (),
        store: ExecutableStore | None = None,
    ) -> None:
        if store is not None:
            t0 = time.perf_counter()
            try:
                compiled = store.load(key)
            except BaseException as e:
                self._fail(key, future, e)
                return
            seconds = time.perf_counter() - t0
            with self._lock:
                stats.load_seconds += seconds
                if compiled is not None:
                    self._done[key] = compiled
                    self.version += 1
                    del self._pending[key]
                    stats.loaded += 1
            if compiled is not None:
                store.count_load(seconds)
                future.set_result(compiled)
                return
        t0, hits0 = time.perf_counter(), PROCESS.thread_hits()
        try:
            lowered = lower()
            t1 = time.perf_counter()
            compiled = lowered.compile(compiler_options=dict(options)) if options else lowered.compile()
        except BaseException as e:
            self._fail(key, future, e)
            return
        seconds, hits = time.perf_counter() - t0, PROCESS.thread_hits() - hits0
        with self._lock:
            self._done[key] = compiled
            self.version += 1
            del self._pending[key]
            stats.count += 1
            stats.seconds += seconds
            stats.lower_seconds += t1 - t0
            stats.cache_hits += min(hits, 1)
        future.set_result(compiled)
        # Only what XLA compiled in this process goes into the store: an XLA:CPU executable that JAX loaded from
        # its persistent cache serializes without its compiled functions (jax 0.11.2), and once loaded back from
        # the store it fails on its first call (`NOT_FOUND: Function wrapped_iota not found`).
        if store is not None and hits == 0:
            store.save(key, compiled)
