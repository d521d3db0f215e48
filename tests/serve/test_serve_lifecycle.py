"""Whole-server lifecycle: an engine loop that dies, and SIGTERM draining a real `paged-jax serve` process."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from serve.client import Client
from serve.config import ServingConfig
from serve.engine_loop import EngineLoop
from serve.proto.paged_jax.v1 import generate_pb2 as pb
from serve.server import EXIT_ENGINE_DIED, ServerThread, serve_forever

from support.serve_process import ServeProcess
from support.serve_support import PROMPTS, shared, small_engine, start_server, wait_until

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_engine_loop_death_ends_every_stream_unavailable(monkeypatch):
    engine = small_engine()  # a second engine (this one dies) on the shared engine's weights
    loop = EngineLoop(engine).start()
    server = ServerThread(loop, ServingConfig(port=0)).start()
    try:
        with Client(server.target) as client:
            calls = [
                client.generate_stream(PROMPTS[i], timeout=60, temperature=0, max_tokens=1500, ignore_eos=True)
                for i in range(3)
            ]
            for c in calls:
                assert next(c).HasField("chunk")
            real_step = engine.step

            def failing_step():
                real_step()
                raise RuntimeError("injected device failure")

            monkeypatch.setattr(engine, "step", failing_step)
            start = time.monotonic()
            for c in calls:
                with pytest.raises(grpc.RpcError) as e:
                    list(c)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "injected device failure" in e.value.details()
            assert time.monotonic() - start < 5
            deadline = time.monotonic() + 5
            while client.health() != NOT_SERVING:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert client.health(pb.DESCRIPTOR.services_by_name["GenerationService"].full_name) == NOT_SERVING
            for call in (lambda: client.generate("x", max_tokens=2, timeout=5), lambda: client.stats(timeout=5)):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_serve_forever_exits_nonzero_when_the_engine_dies(monkeypatch):
    """A dead engine loop ends open streams UNAVAILABLE and then the serving process itself, with a non-zero
    status, so a supervisor restarts it (it used to stay up, NOT_SERVING, for ever)."""
    engine = small_engine()
    fail = threading.Event()
    real_step = engine.step

    def step():
        if fail.is_set():
            raise RuntimeError("injected device failure")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    codes: list[grpc.StatusCode] = []

    def stream() -> None:
        with Client(f"127.0.0.1:{port}") as client:
            while True:
                try:
                    client.health(timeout=1)
                    break
                except grpc.RpcError:
                    time.sleep(0.05)
            call = client.generate_stream(PROMPTS[0], timeout=120, temperature=0, max_tokens=1500, ignore_eos=True)
            assert next(call).HasField("chunk")
            fail.set()
            try:
                list(call)
            except grpc.RpcError as e:
                codes.append(e.code())

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    # front_nice=0: serve_forever runs on pytest's main thread here, whose priority every later test would keep
    assert asyncio.run(serve_forever(engine, ServingConfig(port=port, front_nice=0))) == EXIT_ENGINE_DIED != 0
    thread.join(30)
    assert codes == [grpc.StatusCode.UNAVAILABLE]


class SteppedClock:
    """The drain's grace-period clock, moved only by the test: which streams finish inside the grace period is
    then decided by the test's steps, not by how fast this machine generates tokens."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_drain_lets_open_streams_finish_then_aborts_the_rest_at_the_deadline():
    server = start_server()
    clock = server.server.clock = SteppedClock()
    try:
        with Client(server.target) as client:
            short = client.generate_stream(PROMPTS[0], timeout=120, temperature=0, max_tokens=20, ignore_eos=True)
            long = client.generate_stream(PROMPTS[1], timeout=120, temperature=0, max_tokens=1800, ignore_eos=True)
            assert next(short).HasField("chunk") and next(long).HasField("chunk")
            stopper = threading.Thread(target=server.stop, args=(10.0,))  # 10 s of grace on the stepped clock
            stopper.start()
            wait_until(lambda: client.health() == NOT_SERVING, "health NOT_SERVING while draining")
            with pytest.raises(grpc.RpcError) as e:
                client.generate(PROMPTS[2], max_tokens=2, timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            # The clock stands still: the short stream runs to its end however long that takes here.
            short_final = [r for r in short if r.HasField("final")]
            assert [s.finish_reason for s in short_final[0].final.samples] == [pb.FINISH_REASON_LENGTH]
            assert stopper.is_alive()  # the long stream holds the drain open
            clock.now += 10.0  # the grace period ends
            long_final = [r for r in long if r.HasField("final")]
            assert [s.finish_reason for s in long_final[0].final.samples] == [pb.FINISH_REASON_ABORT]
            assert "shutting down" in long_final[0].final.message
            assert 0 < long_final[0].final.usage.completion_tokens < 1800
            stopper.join(60)
            assert not stopper.is_alive()
        kv = shared().engine.kv  # every page of both streams returned
        wait_until(lambda: shared().loop.num_open == 0 and kv.stats().pages_in_use == 0, "every page returned")
    finally:
        server.stop()


def _start_subprocess(grace: float) -> tuple[ServeProcess, str]:
    """A serving process on the tiny model, returned once its background warm-up has compiled every shape."""
    server = ServeProcess(
        *("--model", "tiny", "--grpc-port", "0", "--no-http", "--num-pages", "300", "--max-num-seqs", "8"),
        *("--max-num-batched-tokens", "16", "--attention-backend", "xla", "--grace-period", str(grace)),
    )
    try:
        target = server.wait_for(r"serving \S+ on (\S+:\d+)").group(1)
        server.wait_for("background warm-up:")  # every shape compiled: health SERVING
        server.drain()
        with Client(target) as client:
            assert client.health() == SERVING
    except BaseException:
        server.__exit__(None, None, None)  # killed
        raise
    return server, target


@pytest.mark.slow  # a fresh process (start-up and compiles)
def test_sigterm_aborts_open_streams_and_exits_zero():
    """SIGTERM reaches the drain of a real process (the drain itself: the test above): with no grace period,
    a stream far from its end gets a final ABORT message naming the shutdown, and the process exits 0."""
    server, target = _start_subprocess(grace=0.0)
    with server:
        with Client(target) as client:
            long = client.generate_stream(PROMPTS[1], timeout=60, temperature=0, max_tokens=1800, ignore_eos=True)
            assert next(long).HasField("chunk")
            server.proc.send_signal(signal.SIGTERM)
            long_final = [r for r in long if r.HasField("final")]
            assert [s.finish_reason for s in long_final[0].final.samples] == [pb.FINISH_REASON_ABORT]
            assert "shutting down" in long_final[0].final.message
            assert 0 < long_final[0].final.usage.completion_tokens < 1800
        assert server.proc.wait(timeout=30) == 0


@pytest.mark.slow  # a fresh process (start-up and compiles)
def test_sigterm_during_warmup_exits_zero():
    with ServeProcess(
        *("--model", "tiny", "--grpc-port", "0", "--no-http", "--num-pages", "300", "--max-num-seqs", "64"),
        *("--max-num-batched-tokens", "512", "--attention-backend", "xla"),
        env={"PAGED_JAX_COMPILE_CACHE": "off"},
    ) as server:
        server.wait_for("KV cache:")  # the engine logs its KV capacity just before warm-up starts
        assert server.sigterm() == 0
