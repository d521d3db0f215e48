"""`paged-jax serve --distributed` with 2 (and 4) CPU processes on loopback (`serve.multihost`): greedy token ids
identical to one process over the same devices, a follower killed mid-run or stuck ends process 0 with a clear
error within a bound, a follower that finds no coordinator ends with a one-line error, and flags multi-host
serving does not run are refused before anything loads."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from paged_jax.errors import UsageError
from serve import multihost
from serve.client import Client

from support.serve_process import ROOT, ServeProcess, free_port, wait_for_health

FLAGS = ["tiny", "--num-pages", "64", "--max-model-len", "256", "--no-warmup", "--max-num-seqs", "4"]
PROMPTS = [list(range(3, 40)), list(range(50, 61)), list(range(3, 40)) + [9, 9, 9]]


def _generate(target: str) -> list[list[int]]:
    with Client(target) as client:
        wait_for_health(client, 300)
        out = []
        for prompt in PROMPTS:
            reply = client.generate(prompt, timeout=300, temperature=0, max_tokens=10, ignore_eos=True, n=1)
            out.append(list(reply.completions[0].token_ids))
        return out


class Job:
    """`count` processes of `paged-jax serve --distributed` on loopback; process 0 serves gRPC on `self.grpc`."""

    def __init__(self, count: int, *extra: str) -> None:
        coordinator = f"127.0.0.1:{free_port()}"
        self.grpc = free_port()
        self.procs = []
        for pid in reversed(range(count)):
            argv = [*FLAGS, "--coordinator-address", coordinator, "--num-processes", str(count)]
            argv += ["--process-id", str(pid), *extra]
            if pid == 0:
                argv += ["--grpc-port", str(self.grpc), "--port", str(free_port())]
            self.procs.insert(0, ServeProcess(*argv))
        for proc in self.procs:
            proc.drain()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()

    def output(self, i: int) -> str:
        return "".join(self.procs[i].lines)


@pytest.mark.slow  # fresh processes: start-up and compiles
@pytest.mark.parametrize("count", [2, 4])
def test_processes_match_one_and_stop_together(count):
    """`count` processes of one device each give the greedy ids of one process over `count` host devices (the
    same TP mesh), and SIGTERM to process 0 stops every follower with status 0."""
    devices = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
    g = free_port()
    argv = [*FLAGS, "-tp", str(count), "--grpc-port", str(g), "--port", str(free_port())]
    with ServeProcess(*argv, env={"XLA_FLAGS": devices}) as one:
        one.drain()
        expected = _generate(f"127.0.0.1:{g}")
        assert one.sigterm() == 0
    with Job(count) as job:
        assert _generate(f"127.0.0.1:{job.grpc}") == expected
        assert job.procs[0].sigterm() == 0
        for follower in job.procs[1:]:
            assert follower.proc.wait(timeout=60) == 0  # told to stop by process 0
        log = job.output(0)
        assert "multi-host: " in log and "bytes/step sent" in log
        assert "stopped by process 0" in job.output(count - 1)


@pytest.mark.slow
def test_killed_follower_ends_the_server_with_a_clear_error():
    with Job(2, "--distributed-timeout", "5") as job:
        target = f"127.0.0.1:{job.grpc}"
        _generate(target)
        job.procs[1].proc.kill()  # mid-run: the next step's collectives break
        t0 = time.monotonic()
        with Client(target) as client, pytest.raises(grpc.RpcError) as err:
            client.generate(PROMPTS[0], timeout=60, temperature=0, max_tokens=50)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert job.procs[0].proc.wait(timeout=60) == 1
        assert time.monotonic() - t0 < 30
        assert "FollowerLost" in job.output(0)


@pytest.mark.slow
def test_stuck_follower_is_found_by_the_heartbeat():
    with Job(2, "--distributed-timeout", "3") as job:
        _generate(f"127.0.0.1:{job.grpc}")
        follower = job.procs[1].proc
        follower.send_signal(signal.SIGSTOP)  # idle and stuck: no step will notice; the watchdog does
        try:
            t0 = time.monotonic()
            assert job.procs[0].proc.wait(timeout=60) == 1
            assert time.monotonic() - t0 < 20
        finally:
            follower.send_signal(signal.SIGCONT)
        assert "process 1 of 2 sent no heartbeat" in job.output(0)


@pytest.mark.slow  # a fresh process
def test_unsupported_flags_are_refused():
    cmd = [sys.executable, "-m", "serve", "serve", "tiny", "--distributed", "-dp", "2"]
    res = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
    assert res.returncode == 2
    assert "--data-parallel-size: not supported with --distributed" in res.stderr


@pytest.mark.slow  # a fresh process
def test_an_unreachable_coordinator_is_a_one_line_error():
    """A follower pointed at an address where no process 0 listens ends with exit 2 and one line naming the flag
    (JAX's own connect would abort the process with a native stack trace after its timeout)."""
    port = free_port()  # nothing listens on it
    cmd = [sys.executable, "-m", "serve", "serve", "tiny", "--distributed", "--coordinator-address",
           f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1", "--distributed-timeout", "1"]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"--coordinator-address 127.0.0.1:{port}: no coordinator answered within 10 s" in res.stderr
    assert "Check failure" not in res.stderr and "Traceback" not in res.stderr


def test_a_follower_waits_for_a_coordinator_that_comes_up():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        threading.Timer(0.3, s.listen).start()  # process 0 starts a little after its follower
        multihost.wait_for_coordinator(f"127.0.0.1:{port}", timeout_s=30, poll_s=0.05)
    with pytest.raises(UsageError, match="expected HOST:PORT"):
        multihost.wait_for_coordinator("localhost", timeout_s=1)
