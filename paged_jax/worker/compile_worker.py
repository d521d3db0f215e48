"""Who compiles a shape a request needs, so that no step waits for it? One daemon thread per runner.

The engine's admission gate (`paged_jax.engine.compile_gate`) hands it the executables a waiting request lacks;
it compiles them one at a time in the order asked (each once: the process's registry already makes a second
compile of a key wait for the first, `paged_jax.worker.executables`), while the engine thread goes on stepping the
requests whose shapes are compiled. XLA's compile releases the GIL, so the two overlap. A background warm-up's
threads take queued jobs first (`assist`): a request's shapes never wait behind the warm-up.

A compile that fails is remembered with its error: the gate then fails the requests that need it, alone, instead
of waiting for it forever. `hold` (tests) runs on the thread before each compile: a test can hold a compile in
flight for as long as it likes and count what the engine does meanwhile.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Hashable, Iterable

from paged_jax.worker.compile_jobs import Job

log = logging.getLogger(__name__)


class CompileWorker:
    """Compiles requested jobs on one daemon thread (started with the first request). `compile_one(job)` builds
    one executable into the registry; `ready(job)` says whether it is there already."""

    def __init__(self, compile_one: Callable[[Job], object], ready: Callable[[Job], bool]) -> None:
        self._compile_one = compile_one
        self._ready = ready
        self._cond = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._wanted: set[Hashable] = set()  # keys queued or compiling
        self._thread: threading.Thread | None = None
        self._closed = False
        self.failed: dict[Hashable, BaseException] = {}  # key -> why its compile failed
        self.compiled = 0  # jobs this worker finished (compiled, loaded, or failed)
        self.hold: Callable[[Job], None] | None = None  # tests: runs on the thread before each compile

    @property
    def busy(self) -> int:
        """Jobs queued or compiling."""
        return len(self._wanted)

    def want(self, jobs: Iterable[Job]) -> None:
        """Queue every job that is neither compiled, queued, compiling nor failed."""
        with self._cond:
            if self._closed:
                return
            for job in jobs:
                if job.key in self._wanted or job.key in self.failed or self._ready(job):
                    continue
                self._wanted.add(job.key)
                self._queue.append(job)
            if self._queue and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="compile-worker", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait(self, timeout: float) -> None:
        """Return when a job finishes, or after `timeout` seconds, or at once when nothing is queued."""
        with self._cond:
            if self._wanted:
                self._cond.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Start no more compiles; wait up to `timeout` for the one running (an XLA compile still running while
        the interpreter exits can crash it)."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def assist(self) -> None:
        """Compile queued jobs on the caller's thread until none is left queued. A background warm-up calls it
        before each of its own compiles, so what requests wait for goes ahead of the warm-up's queue and on
        every compile thread, not on this worker's one alone."""
        while True:
            with self._cond:
                if not self._queue or self._closed:
                    return
                job = self._queue.popleft()
            self._do(job)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    self._wanted.clear()
                    self._cond.notify_all()
                    return
                job = self._queue.popleft()
            self._do(job)

    def _do(self, job: Job) -> None:
        try:
            if self.hold is not None:
                self.hold(job)
            self._compile_one(job)
        except BaseException as e:  # noqa: BLE001 - remembered; the requests needing it fail alone
            log.exception("compiling %s failed", job.describe)
            with self._cond:
                self.failed[job.key] = e
        with self._cond:
            self._wanted.discard(job.key)
            self.compiled += 1
            self._cond.notify_all()
