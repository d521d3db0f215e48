"""The grpc.aio server around one engine loop: services, health, reflection, auth, TLS, graceful drain.

`GrpcServer` is one front end (ports, interceptors, servicer); it does not own the engine loop, so
tests can put several front ends (plain, TLS, with auth) on one engine. `serve_forever` is the
`paged-jax serve` process: it owns the loop, the metrics endpoint and the SIGTERM/SIGINT handling.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from paged_jax.engine.protocol import Engine
from paged_jax.lora.named import serve_lora_modules
from paged_jax.lora.peft import LoraAdapter
from paged_jax.lora.registry import AdapterCache
from paged_jax.worker.warmup import WarmupProgress, serving_plans

from .auth import BearerTokenInterceptor, server_credentials
from .background import BackgroundServer
from .config import ServingConfig
from .engine_loop import EngineLoop
from .front_priority import lower_thread_priority
from .kv_events import KVEventHub, attach
from .metrics import Metrics
from .openai_api.server import start_http_front
from .ports import PortInUseError
from .servicer import SERVICE_NAME, GenerationServicer, generic_handler

log = logging.getLogger(__name__)


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class GrpcServer:
    """One gRPC front end over `loop`; create, `await start()`, later `await drain_and_stop()`."""

    def __init__(self, loop: EngineLoop, config: ServingConfig, metrics: Metrics | None = None) -> None:
        config.validate()
        self.loop, self.config = loop, config
        self.metrics = metrics or Metrics()
        self.servicer = GenerationServicer(loop, config, self.metrics)
        self.health = health_aio.HealthServicer()
        self.status: int = NOT_SERVING  # the health status last set (the HTTP front's /health follows it)
        self.port: int | None = None
        self._server: aio.Server | None = None
        self._warm_up_cancel = threading.Event()
        self._warm_up_thread: threading.Thread | None = None
        self.warmup_progress: WarmupProgress | None = None  # set by start_warm_up (/health and metrics read it)
        self.clock: Callable[[], float] = time.monotonic  # the grace period's clock (a test steps its own)

    async def start(self, serving: bool = True) -> int | None:
        """Listen; health SERVING at once, or with `serving=False` NOT_SERVING (until `start_warm_up` is ready)."""
        cfg = self.config
        interceptors = [BearerTokenInterceptor(cfg.auth_token, cfg.auth_exempt_health)] if cfg.auth_token else []
        for warning in cfg.warnings():
            log.warning(warning)
        options = [("grpc.max_receive_message_length", cfg.limits.max_message_bytes), ("grpc.so_reuseport", 0)]
        server = aio.server(interceptors=interceptors, options=options)
        server.add_generic_rpc_handlers([generic_handler(self.servicer)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server
        )
        address = f"{cfg.host}:{cfg.port}"
        try:
            if cfg.port is None:  # --no-grpc: the server still holds health and the drain, listening nowhere
                pass
            elif (tls := cfg.tls_files) is not None:
                self.port = server.add_secure_port(address, server_credentials(*tls))
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError as e:  # grpc's "Failed to bind": the port was taken after the start-up check
            raise PortInUseError(f"--grpc-port: {address} cannot be bound ({e}); pick another port, or 0") from None
        await server.start()
        self._server = server
        aio_loop = asyncio.get_running_loop()
        self.loop.add_death_callback(lambda e: aio_loop.call_soon_threadsafe(self._on_engine_death, e))
        await self._set_all(SERVING if serving and self.loop.alive else NOT_SERVING)
        self.metrics.queued_fn = lambda: self.loop.num_queued
        if self.port is not None:
            log.info(
                "serving %s on %s:%d (tls %s, auth %s)",
                SERVICE_NAME,
                cfg.host,
                self.port,
                cfg.tls,
                cfg.auth_token is not None,
            )
        return self.port

    def start_warm_up(self, engine) -> threading.Thread:
        """Compile the decode shapes on a background thread (health stays NOT_SERVING), then report SERVING and
        compile every other shape on the same thread; a step that needs one of those waits for its compile.
        Returns the thread; `stop_warm_up` ends it. Its progress is `warmup_progress` (also the metrics')."""
        ec = engine.engine_config
        first, rest = serving_plans(ec.max_num_seqs, ec.async_scheduling)
        aio_loop = asyncio.get_running_loop()
        cancel = self._warm_up_cancel
        tracker = self.warmup_progress = WarmupProgress()
        self.metrics.warmup_fn = lambda: tracker

        def ready() -> None:
            if self.loop.alive and not self.servicer.draining:
                asyncio.ensure_future(self._set_all(SERVING))

        def work() -> None:
            try:
                engine.warmup(first, False, cancel=cancel, tracker=tracker)
            except Exception:  # noqa: BLE001 - a shape that cannot compile: stay NOT_SERVING, say why
                log.exception("warm-up failed: health stays NOT_SERVING")
                tracker.finish()
                return
            try:
                aio_loop.call_soon_threadsafe(ready)
            except RuntimeError:  # the event loop has closed (shut down during warm-up): nothing to report to
                tracker.finish()
                return
            try:
                engine.warmup(rest, False, what="background warm-up", cancel=cancel, tracker=tracker)
            except Exception:  # noqa: BLE001 - what it missed compiles when a step first needs it
                log.exception("background warm-up failed")
            tracker.finish()

        thread = self._warm_up_thread = threading.Thread(target=work, name="warm-up", daemon=True)
        thread.start()
        return thread

    async def stop_warm_up(self) -> None:
        """Start no more compiles and wait for the running ones (an XLA compile still running while the
        interpreter exits can crash it)."""
        self._warm_up_cancel.set()
        if self._warm_up_thread is not None:
            await asyncio.to_thread(self._warm_up_thread.join)
        await asyncio.to_thread(self.loop.engine.stop_compiles)

    def _on_engine_death(self, error: BaseException) -> None:
        log.error("engine loop died (%s): health NOT_SERVING", error)
        self.metrics.engine_alive.set(0)
        asyncio.ensure_future(self._set_all(NOT_SERVING))

    async def _set_all(self, status) -> None:
        self.status = status
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def drain_and_stop(self, grace_period_s: float | None = None) -> None:
        """Health NOT_SERVING and refuse new generations, let open ones finish for the grace period, abort
        the rest (each gets a final ABORT message), then stop the server."""
        self._warm_up_cancel.set()  # no new compiles compete with the draining requests
        grace = self.config.grace_period_s if grace_period_s is None else grace_period_s
        self.servicer.draining = True
        await self.health.enter_graceful_shutdown()
        deadline = self.clock() + grace
        while self.loop.num_open and self.clock() < deadline:
            await asyncio.sleep(0.02)
        if self.loop.num_open:
            log.warning("grace period over: aborting %d open requests", self.loop.num_open)
            self.loop.abort_all("aborted: the server is shutting down")
            flush_deadline = time.monotonic() + 5.0
            while self.loop.num_open and time.monotonic() < flush_deadline:
                await asyncio.sleep(0.02)
        assert self._server is not None  # started
        await self._server.stop(grace=1.0)  # lets the final messages reach their clients
        await self.stop_warm_up()

    async def wait_for_termination(self) -> None:
        assert self._server is not None  # started
        await self._server.wait_for_termination()


class ServerThread(BackgroundServer):
    """A `GrpcServer` on its own event loop thread (tests, embedding); `start()` returns once it listens."""

    def __init__(self, loop: EngineLoop, config: ServingConfig, metrics: Metrics | None = None) -> None:
        super().__init__(GrpcServer(loop, config, metrics), "grpc-server")
        self._stopped: asyncio.Event | None = None

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def target(self) -> str:
        return f"{self.server.config.host}:{self.port}"

    async def _serve(self) -> None:
        self._stopped = asyncio.Event()
        await self._stopped.wait()

    async def _shutdown(self, grace_period_s: float) -> None:
        await self.server.drain_and_stop(grace_period_s)
        if self._stopped is not None:
            self._stopped.set()


EXIT_ENGINE_DIED = 1  # the process status when the engine loop dies: a supervisor should restart the server


async def serve_forever(
    engine: Engine,
    config: ServingConfig,
    warm_up: bool = False,
    checked_adapters: Mapping[str, LoraAdapter] | None = None,
) -> int:
    """Run until SIGTERM/SIGINT, then drain for `config.grace_period_s` and return 0.

    If the engine loop dies (its state is unknown, so nothing more can be served), every open stream has
    already ended with UNAVAILABLE; the server then stops and this returns `EXIT_ENGINE_DIED`, so the
    process ends with a non-zero status and a supervisor (systemd, Kubernetes) restarts it, as vLLM does.

    `warm_up`: the engine was built without warm-up; health is NOT_SERVING until its decode shapes are
    compiled, and the rest compile in the background (`GrpcServer.start_warm_up`). `checked_adapters`: the
    `--lora-modules` adapters the start-up check read, by name, handed to the engine's adapter cache.
    """
    stop = asyncio.Event()
    aio_loop = asyncio.get_running_loop()
    log.info("fronts on the %s event loop", type(aio_loop).__module__.split(".")[0])
    for sig in (signal.SIGTERM, signal.SIGINT):  # first, so a signal never lands while threads start
        aio_loop.add_signal_handler(sig, stop.set)
    metrics = Metrics()
    hub = kv_event_hub(engine, config)
    loop = EngineLoop(engine, on_step=metrics.on_step if hub is None else hub.after_step(metrics.on_step))
    loop.kv_events = hub
    cache = getattr(engine, "adapters", None)  # one engine's (a data-parallel engine's replicas read on first use)
    cache = cache if isinstance(cache, AdapterCache) else None
    serve_lora_modules(loop.adapters, config.lora_modules, checked_adapters, cache)
    loop.start()
    lower_thread_priority(config.front_nice)  # the fronts start below, on this thread or ones it starts
    metrics.engine_alive.set(1)
    if config.metrics_port is not None:
        token = config.auth_token if config.metrics_auth else None
        tls = config.tls_files if token is not None else None
        metrics_port = metrics.serve(config.metrics_host, config.metrics_port, token=token, tls=tls)
        scheme = "https" if tls else "http"
        log.info(
            "metrics on %s://%s:%d/metrics (auth %s)", scheme, config.metrics_host, metrics_port, token is not None
        )
    server = GrpcServer(loop, config, metrics)
    port = await server.start(serving=not warm_up)
    name = config.served_model_names[0] if config.served_model_names else engine.config.name
    if port is not None:
        print(f"paged-jax serving {name} on {config.host}:{port} (gRPC)", flush=True)
    http = await start_http_front(loop, config, metrics)  # None unless an HTTP port is set
    if http is not None:
        http.front.ready = lambda: server.status == SERVING  # /health 503 while warming up, as gRPC's health
        http.front.warmup = lambda: server.warmup_progress  # and says how far it has got
    died: list[BaseException] = []

    def on_death(error: BaseException) -> None:  # runs on the engine loop thread
        died.append(error)
        aio_loop.call_soon_threadsafe(stop.set)

    loop.add_death_callback(on_death)
    if warm_up and not stop.is_set():  # a SIGTERM during start-up: no compile to wait for on the way out
        server.start_warm_up(engine)
    await stop.wait()
    if died:
        log.error(
            "engine loop died (%s: %s): stopping with exit status %d so that a supervisor restarts the server",
            type(died[0]).__name__,
            died[0],
            EXIT_ENGINE_DIED,
        )
        await server.drain_and_stop(grace_period_s=0.0)  # open streams already ended UNAVAILABLE
        if http is not None:
            await http.stop()
        metrics.close()
        if hub is not None:
            hub.close()
        return EXIT_ENGINE_DIED
    log.info("shutting down: draining for up to %.1f s", config.grace_period_s)
    if http is not None:
        http.front.draining = True  # both fronts refuse new work; the gRPC drain waits for every open request
    await server.drain_and_stop()
    if http is not None:
        await http.stop()
    loop.stop()
    metrics.close()
    if hub is not None:
        hub.close()
    return 0


def kv_event_hub(engine: Engine, config: ServingConfig) -> KVEventHub | None:
    """The KV events' hub when `--kv-events-config` enables them (pyzmq and msgpack load only then)."""
    if config.kv_events is None or not config.kv_events.enable_kv_cache_events:
        return None
    hub = attach(engine, config.kv_events)
    for publisher in hub.publishers:
        log.info("kv events on %s (replay: %s)", publisher.endpoint, publisher.replay_endpoint or "off")
    return hub
