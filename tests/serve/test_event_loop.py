"""The serving process's event loop (`serve.event_loop`): uvloop's where installed, and gRPC's asyncio server and
client work on it (both fronts share it in `paged-jax serve`; the HTTP front on it: `test_serve_command`)."""

from __future__ import annotations

import asyncio
import sys

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from serve.event_loop import LOOP_NAME, loop_factory


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop does not run on Windows")
def test_the_serving_loop_is_uvloops() -> None:
    import uvloop

    assert LOOP_NAME == "uvloop"
    loop = loop_factory()()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_a_grpc_asyncio_server_answers_on_the_serving_loop() -> None:
    async def round_trip() -> tuple[str, int]:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return type(asyncio.get_running_loop()).__module__, reply.status
        finally:
            await server.stop(None)

    module, status = asyncio.run(round_trip(), loop_factory=loop_factory())
    assert module.split(".")[0] == LOOP_NAME
    assert status == health_pb2.HealthCheckResponse.SERVING
