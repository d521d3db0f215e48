"""The ASGI app (FastAPI): the OpenAI routes (completions, chat, embeddings, responses), vLLM's tokenizer routes
(`/tokenize`, `/detokenize`, `/tokenizer_info`), `/health` (and vLLM's `/ping`), `/version`, `/metrics`, and
errors in OpenAI's shape.

Auth (when a token is configured) covers `/v1/*` and the tokenizer routes; `/health` follows the gRPC rule for
health checks (`auth_exempt_health`, on by default) so load balancers need no token; `/metrics` too unless
`metrics_auth`.
"""

from __future__ import annotations

import importlib.metadata

import grpc
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..convert import RequestError
from .embeddings import embeddings
from .errors import error_response
from .front import OpenAIFront
from .responses_api import ResponsesRoute

try:
    VERSION = importlib.metadata.version("paged-jax")
except importlib.metadata.PackageNotFoundError:  # a checkout run without installing
    VERSION = "unknown"

_HTTP_CODES = {404: grpc.StatusCode.NOT_FOUND}


def create_app(front: OpenAIFront) -> FastAPI:
    app = FastAPI(title="paged-jax OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError) -> JSONResponse:
        return error_response(e.code, e.message, param=e.field)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 405:  # GET/HEAD/OPTIONS on a POST route: 405 with Allow, not a 500
            message = f"{request.method} {request.url.path}: method not allowed"
            body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "method"}}
            return JSONResponse(body, status_code=405, headers=e.headers)
        return error_response(
            _HTTP_CODES.get(e.status_code, grpc.StatusCode.UNKNOWN), f"{request.method} {request.url.path}: {e.detail}"
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await front.generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await front.generate(request, "chat")

    @app.post("/v1/embeddings")
    async def embeddings_route(request: Request) -> Response:
        return await embeddings(front, request)

    responses = ResponsesRoute(front)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses.create(request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        return await responses.retrieve(request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return await responses.delete(request, response_id)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await front.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await front.detokenize(request)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        return front.tokenizer_info(request)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        front.check_auth(request)
        return JSONResponse(front.models())

    if front.config.enable_lora_runtime_updates:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            return await front.load_adapter(request)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            return await front.unload_adapter(request)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        return await front.reset_prefix_cache(request)

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 while serving (with the warm-up's progress by phase, when the server warms up, and the requests held
        back for a compile of their own and the shapes queued for one); 503 while warming up (saying how far it has
        got), draining, or once the engine loop died."""
        front.check_auth(request, exempt=True)
        why = front.health()
        if why is None:
            progress = front.warmup()  # the background warm-up's progress, once it serves
            if progress is None:
                return JSONResponse({"status": "ok"})
            value = front.metrics.registry.get_sample_value  # gauges the engine thread sets after each step
            compiling = {
                "requests_waiting": int(value("paged_jax_requests_waiting_for_compile") or 0),
                "shapes_queued": int(value("paged_jax_compiles_queued") or 0),
            }
            return JSONResponse({"status": "ok", "warmup": progress.as_dict(), "compiling": compiling})
        return error_response(grpc.StatusCode.UNAVAILABLE, f"server: {why}")

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping(request: Request) -> Response:
        """vLLM's (SageMaker's) health route: the same answer as /health."""
        return await health(request)

    @app.get("/version")
    async def version() -> JSONResponse:
        """{"version": the installed paged-jax's}, as vLLM's /version (no auth, like vLLM's)."""
        return JSONResponse({"version": VERSION})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        front.check_auth(request, exempt=not front.config.metrics_auth)
        return Response(generate_latest(front.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
