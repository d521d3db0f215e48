"""Multi-host serving: one server over every process of a JAX multi-controller job (`paged-jax serve --distributed`).

Every process builds the same engine over the global mesh (all processes' devices, tensor parallelism across
hosts). Process 0 is the server: its fronts, scheduler and KV manager decide each step, and its runner hands each
step's `StepPlan` (`paged_jax.worker.step_plan`: the host arrays of the step, a few KiB) to `Leader.send` before the
step's sampling is dispatched. The plan goes once to every follower through the key-value store of JAX's
coordination service (`jax.distributed`; no extra port, over DCN on a TPU slice). A follower (`follow`) runs
each plan on its own runner: the same executables, the same operands, in the same order, so each step's
collectives meet. Followers keep no scheduler state: abort, drain and health are process 0's alone.

Faults end the job, never hang it:
- a follower that dies mid-step breaks the step's collectives: process 0's step raises, the engine loop dies and
  the server stops with `EXIT_ENGINE_DIED`, naming the lost process (`FollowerLost`);
- a follower that is idle-dead or stuck stops incrementing its heartbeat counter; process 0's watchdog notices
  within `timeout_s` and ends the server with the same exit status and a one-line error (the engine thread may
  be parked in a collective that will never complete, so there is nothing left to drain);
- process 0 gone: a follower's next read of the store fails (the coordination service lives in process 0) and
  the follower exits non-zero; JAX's own heartbeat (`heartbeat_timeout_seconds`, four times `timeout_s`) is the
  backstop for both sides (it aborts the process, so it must stay well behind the watchdog, even on a loaded host).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from paged_jax.errors import UsageError
from paged_jax.worker.runner import ModelRunner
from paged_jax.worker.sampler import SamplerOutput
from paged_jax.worker.step_plan import StepPlan, decode_plan, encode_plan

log = logging.getLogger(__name__)

STEP_KEY = "paged_jax/serve/step/{}/{}"  # block, step: a block's messages go in one delete
BLOCK = 256  # messages per block
HEARTBEAT_KEY = "paged_jax/serve/heartbeat/{}"
STOP = b""  # the message that ends every follower's loop
DEFAULT_TIMEOUT_S = 30.0


class FollowerLost(RuntimeError):
    """A follower process stopped taking part in the steps: the multi-host server cannot continue."""


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("multi-host serving needs jax.distributed.initialize() first")
    return client


def initialize(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None, timeout_s: float
) -> None:
    """`jax.distributed.initialize` (gloo collectives on CPU), with JAX's heartbeat at four times `timeout_s` so
    this module's own watchdog reports a lost follower first (JAX's missed heartbeat aborts with SIGABRT; at twice
    `timeout_s` a loaded CI host once let it win the race). On a TPU slice pass None for the three (JAX finds them)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    init_timeout_s = max(10, int(10 * timeout_s))
    if coordinator_address and process_id:  # a follower: JAX aborts with a native stack if no coordinator answers
        wait_for_coordinator(coordinator_address, init_timeout_s)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        heartbeat_timeout_seconds=max(4, int(4 * timeout_s)),
        initialization_timeout=init_timeout_s,
    )


def wait_for_coordinator(address: str, timeout_s: float, poll_s: float = 0.5) -> None:
    """Return once a TCP connection to `address` (host:port, process 0's coordination service) opens; raise a
    one-line `UsageError` naming --coordinator-address after `timeout_s`. A follower started before process 0
    waits for it; one pointed at a wrong address gets a clear error instead of XLA's fatal DEADLINE_EXCEEDED."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError(f"--coordinator-address: expected HOST:PORT, got {address!r}")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=poll_s):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise UsageError(
                    f"--coordinator-address {address}: no coordinator answered within {timeout_s:g} s ({e}); start "
                    "process 0 (--process-id 0) there, or fix the address"
                ) from None
            time.sleep(poll_s)


def check_same_cache(num_pages: int) -> None:
    """Every process must size its KV cache alike (the step's shapes include it): a collective, all call it."""
    from jax.experimental import multihost_utils

    pages = [int(n) for n in np.asarray(multihost_utils.process_allgather(np.array([num_pages], np.int64))).ravel()]
    if len(set(pages)) > 1:
        raise UsageError(f"--num-pages: the processes sized their KV caches differently ({pages}); give --num-pages")


@dataclass(slots=True)
class BroadcastStats:
    """What the per-step broadcast cost process 0: messages, their bytes, and the seconds spent encoding and
    storing them (on the step's critical path)."""

    steps: int = 0
    raw_bytes: int = 0  # the plans' encoded bytes
    bytes: int = 0  # compressed, as sent
    max_bytes: int = 0
    encode_seconds: float = 0.0  # encoding, compressing and queueing: on the step's path
    max_seconds: float = 0.0
    store_seconds: float = 0.0  # the store's set (and deletes), on the sender thread

    def add(self, raw: int, sent: int, encode_s: float) -> None:
        self.steps += 1
        self.raw_bytes += raw
        self.bytes += sent
        self.max_bytes = max(self.max_bytes, sent)
        self.encode_seconds += encode_s
        self.max_seconds = max(self.max_seconds, encode_s)

    def summary(self) -> str:
        if not self.steps:
            return "no steps broadcast"
        n = self.steps
        return (
            f"{n} steps broadcast: {self.bytes / n:.0f} bytes/step sent (max {self.max_bytes}; "
            f"{self.raw_bytes / n:.0f} before compression); on the step's path {self.encode_seconds / n * 1e3:.3f} "
            f"ms/step (max {self.max_seconds * 1e3:.3f}); the store's round trip {self.store_seconds / n * 1e3:.3f} "
            "ms/step on the sender thread"
        )


class Leader:
    """Process 0's end: `send` is the runner's `mirror`; a watchdog thread checks the followers' heartbeats."""

    def __init__(self, runner: ModelRunner, timeout_s: float, on_lost: Callable[[str], None]) -> None:
        self.client = _client()
        self.runner = runner
        self.timeout_s = timeout_s
        self.on_lost = on_lost
        self.followers = list(range(1, jax.process_count()))
        self.stats = BroadcastStats()
        self._outbox: queue.Queue[bytes] = queue.Queue()
        self._closed = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="multihost-sender", daemon=True)
        self._sender.start()
        runner.mirror = self.send
        self._watchdog = threading.Thread(target=self._watch, name="multihost-watchdog", daemon=True)
        self._watchdog.start()

    def send(self, plan: StepPlan) -> None:
        """Queue step `seq`'s plan for every follower; a thread stores the messages in order (the store's round
        trip stays off the step's path)."""
        t0 = time.perf_counter()
        raw = encode_plan(plan)
        data = zlib.compress(raw, 1)  # padding rows and unused bias columns are most of a plan
        self._outbox.put(data)
        self.stats.add(len(raw), len(data), time.perf_counter() - t0)

    def _send_loop(self) -> None:
        """Store each queued message under its block and step number; on entering block b, delete block b - 2:
        every follower has read it, since process 0 has collected a later step (its collectives needed every
        process) before it launched this one. A store failure goes to `on_lost`."""
        seq = 0
        while True:
            data = self._outbox.get()
            t0 = time.perf_counter()
            try:
                self.client.key_value_set_bytes(STEP_KEY.format(seq // BLOCK, seq), data)
                if seq % BLOCK == 0 and seq >= 2 * BLOCK:
                    self.client.key_value_delete(f"paged_jax/serve/step/{seq // BLOCK - 2}")
            except Exception as e:  # noqa: BLE001 - the coordination service failing ends the server too
                self._lost(f"multi-host: storing step {seq} failed ({type(e).__name__}: {e})")
                return
            self.stats.store_seconds += time.perf_counter() - t0
            seq += 1
            self._outbox.task_done()
            if data == STOP:
                return

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell every follower to stop (they exit 0) and stop the watchdog."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.runner.mirror = None
        self._outbox.put(STOP)
        self._sender.join(timeout_s)
        log.info("multi-host: %s", self.stats.summary())

    def _watch(self) -> None:
        """Every follower's heartbeat counter must move within `timeout_s`; else `on_lost` with the reason."""
        seen = {p: (-1, time.monotonic()) for p in self.followers}
        while not self._closed.wait(min(1.0, self.timeout_s / 4)):
            now = time.monotonic()
            for p in self.followers:
                try:
                    beat = self.client.key_value_increment(HEARTBEAT_KEY.format(p), 0)
                except Exception as e:  # noqa: BLE001 - the store itself failing is the same outcome
                    self._lost(f"multi-host: the coordination service failed ({type(e).__name__}: {e})")
                    return
                last, since = seen[p]
                if beat != last:
                    seen[p] = (beat, now)
                elif now - since > self.timeout_s:
                    self._lost(
                        f"multi-host: process {p} of {jax.process_count()} sent no heartbeat for "
                        f"{now - since:.0f} s (--distributed-timeout {self.timeout_s:g} s): it died or hangs"
                    )
                    return

    def _lost(self, message: str) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self.on_lost(message)


class LeaderEngine:
    """Process 0's engine with a step failure named for what it means here: a lost follower (`FollowerLost`).

    Everything else is the wrapped engine's (the `Engine` protocol, by delegation)."""

    def __init__(self, engine, leader: Leader) -> None:
        self._engine = engine
        self.leader = leader

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def step(self):
        try:
            return self._engine.step()
        except Exception as e:
            raise FollowerLost(
                f"multi-host step failed: {type(e).__name__}: {e} (a process of the {jax.process_count()} stopped "
                "taking part; restart the job)"
            ) from e


def follow(runner: ModelRunner, poll_s: float = 0.5) -> int:
    """A follower's loop: run process 0's plans until its STOP (returns 0); process 0 lost or a step broken:
    returns 1. A thread moves this process's heartbeat counter every `poll_s` meanwhile (a step that compiles
    for minutes is not a lost follower). Step n's samples are waited for after step n + 1 is dispatched, so a
    broken collective surfaces here within one step."""
    client = _client()
    me = jax.process_index()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(poll_s):
            try:
                client.key_value_increment(HEARTBEAT_KEY.format(me), 1)
            except Exception:  # noqa: BLE001 - the store gone: the loop below reports it
                return

    threading.Thread(target=beat, name="multihost-heartbeat", daemon=True).start()
    try:
        return _follow(client, runner, me, poll_s)
    finally:
        done.set()


def _follow(client, runner: ModelRunner, me: int, poll_s: float) -> int:
    prev: SamplerOutput | None = None
    seq = 0
    while True:
        try:
            data = client.blocking_key_value_get_bytes(STEP_KEY.format(seq // BLOCK, seq), int(poll_s * 1000))
        except Exception as e:  # noqa: BLE001 - a timeout, or the coordination service gone
            if "DEADLINE_EXCEEDED" in str(e):
                continue
            log.error("multi-host follower %d: process 0 is gone (%s: %s)", me, type(e).__name__, e)
            return 1
        seq += 1
        if data == STOP:
            log.info("multi-host follower %d: stopped by process 0 after %d steps", me, seq - 1)
            return 0
        plan = decode_plan(zlib.decompress(data))
        try:
            samples = runner.replay(plan, prev)
            if prev is not None:
                jax.block_until_ready(prev.tokens)
        except Exception as e:  # noqa: BLE001 - a broken collective: process 0 or another follower is gone
            log.error("multi-host follower %d: step %d failed (%s: %s)", me, seq - 1, type(e).__name__, e)
            return 1
        prev = samples


__all__ = ["BroadcastStats", "FollowerLost", "Leader", "LeaderEngine", "follow", "initialize", "wait_for_coordinator"]
