"""The suite's one launcher of `python -m serve serve ...` as a real process: for what only a fresh process shows
(start-up order, health while warming up, SIGTERM, the exit status). In-process servers are `serve_support`'s."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A loopback TCP port nothing listens on now (for a server process's flags)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_health(client, timeout_s: float) -> None:
    """Poll a gRPC `serve.client.Client`'s health check until it answers; fail after `timeout_s`."""
    import grpc

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.health(timeout=2)
            return
        except grpc.RpcError:
            assert time.monotonic() < deadline, "the server never answered its health check"
            time.sleep(0.2)


class ServeProcess:
    """`python -m serve serve *argv` on CPU with unbuffered output (stdout and stderr as one stream of lines);
    `env` adds to this process's environment, `unset` removes names from it. A context manager: a process still
    running when the block ends is killed (a test ends it itself with `sigterm`, checking the status)."""

    def __init__(self, *argv: str, env: Mapping[str, str] | None = None, unset: Iterable[str] = ()) -> None:
        environ = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **(env or {}))
        for name in unset:
            environ.pop(name, None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serve", "serve", *argv],
            cwd=ROOT,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []  # the output read so far

    def wait_for(self, pattern: str) -> re.Match[str]:
        """Reads the output up to the first line matching `pattern`; AssertionError with the last lines if the
        output ends first."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"no line matching {pattern!r}; the output ended with:\n" + "".join(self.lines[-30:]))

    def drain(self) -> None:
        """Reads the rest of the output into `lines` on a thread, so the process never blocks on a full pipe."""
        assert self.proc.stdout is not None
        stdout = self.proc.stdout
        threading.Thread(target=lambda: self.lines.extend(stdout), daemon=True).start()

    def sigterm(self, timeout: float = 60) -> int:
        """Sends SIGTERM; the exit status once the process has ended."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
