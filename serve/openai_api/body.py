"""An HTTP request's body, bounded by `--max-body-bytes` before any byte of it is parsed.

A JSON body is parsed whole on the front's CPU threads, and Python's parser holds the GIL while it runs (about
0.1 s per MiB), so the engine thread waits meanwhile: a stream of multi-megabyte bodies slows every request
even when each is refused later (a grammar past its 64 KiB limit is only found once the body is parsed).
`read_body` therefore refuses a body larger than the limit before it is parsed: by its `Content-Length`
before a byte is read, and while it streams when there is none (chunked transfer), holding at most the limit.

The refusal is HTTP 413 in OpenAI's error shape (`param: "body"`, the message naming the limit and the flag);
`errors.error_body` maps it. The rest of a refused body is read and dropped, up to `DRAIN_BYTES`, so that a
client that sends its whole body before reading the answer (urllib, curl) sees the 413 rather than a reset
connection; a larger body is answered at once and its connection closed.
"""

from __future__ import annotations

import grpc
from starlette.requests import ClientDisconnect, Request

from ..convert import RequestError

DRAIN_BYTES = 16 * 2**20  # the most of a refused body read (and dropped) before answering


def too_large(limit: int, declared: int | None = None) -> RequestError:
    """RESOURCE_EXHAUSTED naming the body (HTTP 413, `errors.error_body`): gRPC's answer to a message past its
    limit."""
    size = f" ({declared} bytes by its Content-Length)" if declared is not None else ""
    message = f"body: larger than the server's limit of {limit} bytes{size} (--max-body-bytes)"
    return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, "body")


async def read_body(request: Request, limit: int) -> bytes:
    """The body's bytes, or RequestError (HTTP 413) when it has more than `limit`: its declared length checked
    first, then the bytes as they arrive (never more than `limit` of them held)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        if int(declared) <= DRAIN_BYTES:
            await _drain(request, DRAIN_BYTES)
        raise too_large(limit, int(declared))
    parts, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > DRAIN_BYTES:
                break
            if size <= limit:
                parts.append(part)
    except ClientDisconnect:
        if size <= limit:
            raise
    if size > limit:
        raise too_large(limit)
    return b"".join(parts)


async def _drain(request: Request, budget: int) -> None:
    """Read and drop the body, at most `budget` bytes of it (a client gone meanwhile ends it too)."""
    try:
        async for part in request.stream():
            budget -= len(part)
            if budget < 0:
                return
    except ClientDisconnect:
        return
