"""uvicorn serving the OpenAI app on the running asyncio loop, beside the gRPC server and its engine loop.

`HttpServer` is one front end like `GrpcServer`: it does not own the engine loop. It binds `config.host`
(loopback unless `--host`) and `config.http_port`, with the gRPC server's TLS certificate when TLS is on.
uvicorn's own signal handling is off: the process's handler (`serve_forever`) drains both fronts.
`HttpServerThread` runs one on its own event loop thread (tests, embedding).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterator

import uvicorn

from ..background import BackgroundServer
from ..config import ServingConfig
from ..engine_loop import EngineLoop
from ..metrics import Metrics
from ..ports import PortInUseError
from .app import create_app
from .front import OpenAIFront

log = logging.getLogger(__name__)
# The kernel's send buffer per HTTP connection (Linux doubles it). Small, so that a stream whose client stops reading
# blocks, and so reaches its backlog bound (`Backpressure`), within tens of steps rather than hundreds, before it
# has held its sequence slots for long; 128 KiB in flight still carries an SSE stream over any link, while a
# multi-MB unary reply sends at (buffer / round trip). The soak that showed it: docs/benchmarks/soak.md.
SEND_BUFFER_BYTES = 64 * 1024


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the process's own handler drains every front
        yield


class HttpServer:
    """The OpenAI-compatible HTTP front over `loop`; `await start()`, later `await drain_and_stop()`."""

    def __init__(self, loop: EngineLoop, config: ServingConfig, metrics: Metrics | None = None) -> None:
        config.validate()
        self.loop, self.config = loop, config
        self.front = OpenAIFront(loop, config, metrics or Metrics())
        self.app = create_app(self.front)
        self.port: int | None = None
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        cfg = self.config
        port = cfg.http_port if cfg.http_port is not None else 0
        config = uvicorn.Config(
            self.app,
            host=cfg.host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=cfg.tls_cert_file,
            ssl_keyfile=cfg.tls_key_file,
            timeout_graceful_shutdown=5,
        )
        self._server = _Uvicorn(config)
        try:
            sock = config.bind_socket()
        except SystemExit:  # uvicorn exits when it cannot bind: the port was taken after the start-up check
            raise PortInUseError(f"--port: {cfg.host}:{port} cannot be bound; pick another port, or 0") from None
        _bound_unread(sock, cfg.http_send_timeout_s)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:  # uvicorn binds in serve(); a failure ends the task
            if self._task.done():
                self._task.result()
                raise RuntimeError(f"http: could not listen on {cfg.host}:{port}")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        scheme = "https" if cfg.tls else "http"
        log.info(
            "serving the OpenAI API on %s://%s:%d/v1 (auth %s)", scheme, cfg.host, self.port, cfg.auth_token is not None
        )
        return self.port

    async def drain(self, grace_period_s: float) -> None:
        """Refuse new generations (503, /health 503), let open requests of the whole engine finish for the
        grace period, then abort the rest (a stream ends with finish_reason `abort`)."""
        self.front.draining = True
        deadline = time.monotonic() + grace_period_s
        while self.loop.num_open and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.loop.num_open:
            self.loop.abort_all("aborted: the server is shutting down")

    async def stop(self) -> None:
        """Close the listener and the connections (open responses get up to 5 s to send their last bytes)."""
        self.front.draining = True
        if self._server is not None:
            self._server.should_exit = True
            assert self._task is not None  # set with the server
            await self._task


def _bound_unread(sock: socket.socket, timeout_s: float) -> None:
    """Bound what a client that stops reading costs at the socket (accepted connections inherit both options from
    the listener): the kernel's send buffer to `SEND_BUFFER_BYTES` (not autotuned up to megabytes per
    connection), so a stalled client soon blocks the response and its unread events show as its inbox's backlog
    (`Backpressure`); and TCP_USER_TIMEOUT (Linux), so the kernel closes a connection whose sent data stays
    unread for `timeout_s`. uvicorn has no send timeout and waits for a full write buffer to drain before it
    closes, so without it a client that never reads would hold its connection and the bytes buffered for it."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if option is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        log.warning("http: TCP_USER_TIMEOUT is not available; a client that never reads keeps its connection")
        return
    sock.setsockopt(socket.IPPROTO_TCP, option, int(timeout_s * 1000))


class HttpServerThread(BackgroundServer):
    """An `HttpServer` on its own event loop thread; `start()` returns once it listens."""

    def __init__(self, loop: EngineLoop, config: ServingConfig, metrics: Metrics | None = None) -> None:
        super().__init__(HttpServer(loop, config, metrics), "http-server")

    @property
    def base_url(self) -> str:
        scheme = "https" if self.server.config.tls else "http"
        return f"{scheme}://{self.server.config.host}:{self.server.port}/v1"

    async def _serve(self) -> None:
        await self.server._task

    async def _shutdown(self, grace_period_s: float) -> None:
        await self.server.drain(grace_period_s)
        await self.server.stop()


async def start_http_front(loop: EngineLoop, config: ServingConfig, metrics: Metrics) -> HttpServer | None:
    """`paged-jax serve`'s HTTP front when `config.http_port` is set (announced on stdout like gRPC's), else None."""
    if config.http_port is None:
        return None
    http = HttpServer(loop, config, metrics)
    port = await http.start()
    print(f"paged-jax OpenAI API on {'https' if config.tls else 'http'}://{config.host}:{port}/v1", flush=True)
    return http
