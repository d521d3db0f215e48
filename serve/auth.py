"""Transport security: optional TLS credentials and a bearer-token server interceptor."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from grpc import aio

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """TLS from a PEM certificate chain and its private key."""
    return grpc.ssl_server_credentials([(Path(key_file).read_bytes(), Path(cert_file).read_bytes())])


class BearerTokenInterceptor(aio.ServerInterceptor):
    """Lets a call through only with `authorization: Bearer <token>` metadata; UNAUTHENTICATED otherwise.

    The rejection handler has the same streaming shape as the method it replaces, so clients of
    every RPC kind see a clean status. Health checks pass without a token when `exempt_health`.
    """

    def __init__(self, token: str, exempt_health: bool = True) -> None:
        self._expected = token.encode()
        self._exempt_health = exempt_health

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        if self._exempt_health and details.method.startswith(HEALTH_PREFIX):
            return True
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                scheme, _, token = got.partition(b" ")
                ok = hmac.compare_digest(token.strip(b" "), self._expected)  # constant time, whatever the scheme
                return ok and scheme.lower() == b"bearer"  # auth schemes are case-insensitive (RFC 9110)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or self._authorized(details):
            return handler
        return _denying(handler)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "authorization: a valid 'Bearer <token>' is required"

    async def deny_unary(request, context: aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request, context: aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny_unary, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny_unary, **kwargs)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kwargs)
