"""Where `paged-jax serve` listens: `--port` is the OpenAI HTTP API (as in vLLM), `--grpc-port` gRPC.

The old spellings keep working where they are not ambiguous: `--http-port H` is `--port H`, and the old pair
`--port G --http-port H` (gRPC on G, HTTP on H) is read as it was, with a note; `--port` alone now means HTTP.
Both ports are checked before the model loads, so a port in use is one line, not a traceback after minutes
of loading; a port taken between that check and the servers' own binds is the same line (`PortInUseError`).
"""

from __future__ import annotations

import argparse
import errno
import socket
from dataclasses import dataclass

from paged_jax.errors import UsageError

DEFAULT_HTTP_PORT = 8000  # vLLM's
DEFAULT_GRPC_PORT = 50051


class PortInUseError(UsageError):
    """A port a server could not bind; the message names the flag."""


@dataclass(frozen=True, slots=True)
class Ports:
    """Where the two APIs listen (None: that API is off), after the old spellings are read."""

    http: int | None
    grpc: int | None
    note: str | None = None  # a line for stderr when an old spelling was read


def resolve_ports(args: argparse.Namespace) -> Ports:
    """The HTTP and gRPC ports the flags ask for. `--port` is HTTP (as in vLLM) and `--grpc-port` gRPC; the old
    spelling `--http-port` is `--port`, and the old pair `--port G --http-port H` (no --grpc-port) keeps its old
    meaning. UsageError naming the flag when the flags contradict each other."""
    http, grpc, note = args.port, args.grpc_port, None
    if args.http_port is not None:
        if http is not None and grpc is None:  # the old pair: --port was gRPC's
            http, grpc = args.http_port, http
            note = (
                f"--port {grpc} --http-port {http}: read as before (gRPC on {grpc}, HTTP on {http}); "
                f"write --grpc-port {grpc} --port {http}"
            )
        elif http is not None:
            raise UsageError("--http-port: the old spelling of --port; give one of them")
        else:
            http = args.http_port
    if args.no_http and args.no_grpc:
        raise UsageError("--no-http, --no-grpc: nothing left to serve")
    if args.no_http and http is not None:
        raise UsageError(f"--port: {http} is the HTTP port, but --no-http turns HTTP off")
    if args.no_grpc and grpc is not None:
        raise UsageError(f"--grpc-port: {grpc} is the gRPC port, but --no-grpc turns gRPC off")
    http = None if args.no_http else DEFAULT_HTTP_PORT if http is None else http
    grpc = None if args.no_grpc else DEFAULT_GRPC_PORT if grpc is None else grpc
    for flag, port in (("--port", http), ("--grpc-port", grpc)):
        if port is not None and not 0 <= port < 65536:
            raise UsageError(f"{flag}: must be in [0, 65536), got {port}")
    if http is not None and http == grpc and http != 0:
        raise UsageError(
            f"--port: {http} is also the gRPC port; --port is the HTTP (OpenAI) port, gRPC listens on --grpc-port "
            f"(default {DEFAULT_GRPC_PORT})"
        )
    return Ports(http, grpc, note)


def check_ports_free(host: str, ports: Ports) -> None:
    """UsageError naming the flag when a port is already taken, checked before the model loads (a bind now
    and the server's own later can still race: that one fails with the same line)."""
    for flag, port in (("--port", ports.http), ("--grpc-port", ports.grpc)):
        if port:
            check_port_free(host, port, flag)


def check_port_free(host: str, port: int, flag: str) -> None:
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host: cannot resolve {host!r} ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no clash
        try:
            sock.bind(address)
        except OSError as e:
            why = "is in use (another server?)" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise PortInUseError(f"{flag}: {host}:{port} {why}; pick another port, or 0 for a free one") from None
