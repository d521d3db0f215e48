"""Failures in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with HTTP statuses.

Both fronts raise the same `RequestError` (a gRPC status, a message that starts with the field, and the
field in OpenAI's words as `param`); this is the one table from those statuses to HTTP: INVALID_ARGUMENT
400 naming the parameter, UNAUTHENTICATED 401, NOT_FOUND 404 (an unknown model), RESOURCE_EXHAUSTED 429
(the admission queue is full; a body past `--max-body-bytes`, `param` "body", is 413, as gRPC answers a message
past its limit with RESOURCE_EXHAUSTED), UNAVAILABLE 503 (draining, or the engine loop died), anything else 500.
"""

from __future__ import annotations

import grpc
from starlette.responses import JSONResponse

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),  # the server's state forbids it now (busy)
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
}


def error_body(code: grpc.StatusCode, message: str, param: str | None = None) -> tuple[int, dict]:
    """(HTTP status, body) for a request that ended with gRPC status `code`; `param`: the parameter at fault."""
    status, error_type = _STATUS.get(code, (500, "internal_error"))
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and param == "body":  # `body.read_body`: past --max-body-bytes
        status, error_type = 413, "invalid_request_error"
    return status, {"error": {"message": message, "type": error_type, "param": param, "code": code.name.lower()}}


def error_response(code: grpc.StatusCode, message: str, **kwargs) -> JSONResponse:
    status, body = error_body(code, message, **kwargs)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)
