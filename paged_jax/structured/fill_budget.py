"""A step's grammar rows filled one job per row on worker threads, each waited for at most the per-step budget.

One native fill call over every row (llguidance's parallel fill) returns when its slowest row is done, so a row
whose grammar makes its masks costly (shapes the up-front bounds of `regex_bounds` do not foresee) would hold
every step of every request. Here each row is its own job on its own thread (the native fill releases the
GIL, so the jobs run in parallel with each other and with the device's forward pass), and the engine waits
until every job is done or `budget_s` has passed since the fill began, whichever comes first. A row not done
by then is *late*: its mask row stays all ones, and the engine discards its sample and ends its sequence with
finish_reason "error" (`LLMEngine.finish_step`); the other rows go on.

A native fill cannot be interrupted: a late job runs to its end on its thread, which then exits, and the next
step starts a new thread in its place, so no later row ever waits behind it. Each row of a step gets a thread
of its own (kept for the following steps), so a row's budget is never spent queued behind another row.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from paged_jax.structured.backend import Matcher

Fill = Callable[[Sequence[tuple[Matcher, int]], np.ndarray], None]  # `GrammarBackend.fill`


class _Job:
    """One row's fill into its own one-row mask (a late job never writes into a step's mask)."""

    __slots__ = ("done", "error", "finished", "late", "mask", "matcher")

    def __init__(self, matcher: Matcher, words: int) -> None:
        self.matcher = matcher
        self.mask = np.full((1, words), -1, np.int32)
        self.done = threading.Event()
        self.finished = False  # set under the pool's lock, as is `late`
        self.late = False
        self.error: BaseException | None = None


class BudgetedFill:
    """Fills a step's rows with `fill` (the backend's), one thread per row, for at most `budget_s` seconds."""

    def __init__(self, fill: Fill, words: int, budget_s: float) -> None:
        self._fill, self._words, self.budget_s = fill, words, budget_s
        self._lock = threading.Lock()
        self._queue: list[_Job] = []
        self._ready = threading.Condition(self._lock)
        self._threads = 0  # threads taking jobs (a thread running a late job no longer counts)
        self.late_running = 0  # late jobs still running on their threads

    def fill(self, rows: Sequence[tuple[Matcher, int]], bitmask: np.ndarray) -> list[int]:
        """Write each (matcher, r)'s allowed tokens into row r of `bitmask` (int32 [R, words]); return the rows r
        whose fill was not done within the budget (left as they were: all ones)."""
        jobs = [_Job(m, self._words) for m, _ in rows]
        deadline = time.monotonic() + self.budget_s
        with self._lock:
            for _ in range(len(jobs) - self._threads):
                self._threads += 1
                threading.Thread(target=self._work, name="grammar-fill", daemon=True).start()
            self._queue.extend(jobs)
            self._ready.notify(len(jobs))
        late = []
        for job, (_, r) in zip(jobs, rows, strict=True):
            job.done.wait(max(0.0, deadline - time.monotonic()))
            with self._lock:
                if not job.finished:
                    job.late = True
                    late.append(r)
                    if job in self._queue:  # not started yet (its thread not scheduled): it never runs
                        self._queue.remove(job)
                    else:  # it goes on running; its thread ends with it, and the next step starts another
                        self._threads -= 1
                        self.late_running += 1
                    continue
            if job.error is not None:
                raise job.error
            bitmask[r] = job.mask[0]
        return late

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._ready.wait()
                job = self._queue.pop(0)
            try:
                self._fill([(job.matcher, 0)], job.mask)
            except BaseException as e:  # noqa: BLE001 - raised on the engine thread, which waits for it
                job.error = e
            with self._lock:
                job.finished = True
                if job.late:
                    self.late_running -= 1
                    return
            job.done.set()
