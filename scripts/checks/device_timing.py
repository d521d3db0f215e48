"""Kernel timings for the device check: kernel-only time from a device trace, beside host-to-host wall time.

Host-to-host time (``block_until_ready`` around each call) includes dispatch and the small XLA ops around a
kernel, which at tens of microseconds is most of a decode step; the device trace (``jax.profiler``, CUPTI on
a GPU) gives each kernel's own duration. :func:`time_call` returns both: ``kernel_us`` sums the trace events
whose name contains ``kernel_name`` per call (0 when the platform's trace has no device plane, e.g. CPU;
``timing_source`` says which), ``device_us`` every device event per call, ``wall_us`` the host median.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np

H200_HBM_BYTES_PER_S = 4.8e12  # the H200 datasheet's HBM3e bandwidth


@dataclasses.dataclass(frozen=True)
class Timing:
    wall_us: float  # median host-to-host time of one call
    kernel_us: float | None  # trace: summed duration of the named kernels per call (None: no device trace)
    device_us: float | None  # trace: summed duration of every device kernel per call
    timing_source: str  # "trace" or "wall"
    iters: int

    @property
    def best_us(self) -> float:
        return self.kernel_us or self.device_us or self.wall_us

    def fields(self) -> dict:
        return {**dataclasses.asdict(self), "best_us": self.best_us}


def _device_events(trace_dir: pathlib.Path) -> list[tuple[str, float]]:
    """(name, duration ns) of every kernel event on the device planes of the trace under ``trace_dir``."""
    files = sorted(trace_dir.glob("**/*.xplane.pb"))
    if not files:
        return []
    data = jax.profiler.ProfileData.from_file(str(files[-1]))
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        lines = list(plane.lines)
        streams = [line for line in lines if line.name.startswith("Stream")] or lines
        for line in streams:
            events.extend((e.name, float(e.duration_ns)) for e in line.events)
    return events


def time_call(fn: Callable[..., object], *args, iters: int, kernel_name: str = "") -> Timing:
    """Times ``fn(*args)`` (compiled and warmed up first): host median over ``iters`` calls, then ``iters`` calls
    under a device trace; ``kernel_name`` selects the kernel events (empty: every device event)."""
    jax.block_until_ready(fn(*args))
    walls = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        walls.append(time.perf_counter() - t0)
    wall_us = float(np.median(walls)) * 1e6
    with tempfile.TemporaryDirectory() as d:
        try:
            with jax.profiler.trace(d):
                for _ in range(iters):
                    out = fn(*args)
                jax.block_until_ready(out)
            events = _device_events(pathlib.Path(d))
        except Exception:  # noqa: BLE001 - a profiler that cannot start leaves the wall time
            events = []
    if not events:
        return Timing(wall_us, None, None, "wall", iters)
    kernel_ns = sum(ns for name, ns in events if kernel_name in name)
    device_ns = sum(ns for _, ns in events)
    return Timing(wall_us, kernel_ns / iters / 1e3 or None, device_ns / iters / 1e3, "trace", iters)
