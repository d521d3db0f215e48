"""POST /v1/embeddings: OpenAI's embeddings request as the engine's pooling requests, and its response.

`input` is a string, a list of strings, a list of token ids, or a list of token-id lists (one engine request each,
at most `MAX_INPUTS`, submitted as one group like a completions request's prompts); `encoding_format` "float"
(lists of numbers) or "base64" (little-endian float32 bytes, what the official client asks for by default);
`dimensions` keeps the first that many components, then renormalizes (Matryoshka models only,
`paged_jax.config.pooling`); `user` is accepted. vLLM's extras `normalize` (bool) and `pooling` ("last" |
"mean") override the model's pooler per request. A server whose model has no pooler (a generative model started
without `--pooling`) refuses the route with 400 naming `model`, as vLLM serves embeddings only from a pooling
runner. Each input runs as prefill-only steps of the same engine (`paged_jax.pooling_params`); the engine's
input processor checks it as every front's prompts are (an empty input, one longer than the model: 400 naming
`input`).
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass
from typing import Any, TypeGuard

import grpc
import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from paged_jax.config.pooling import PoolerConfig
from paged_jax.engine.input_processor import GenerationRequest, InputProcessor, ProcessedRequest
from paged_jax.errors import FieldError, FieldNames
from paged_jax.outputs import RequestOutput

from .. import convert
from ..convert import RequestError
from ..engine_loop import Submission
from .body import read_body
from .errors import error_response
from .front import OpenAIFront, _finals, _firsts
from .protocol import json_value, typed

METHOD = "OpenAI.Embeddings"
MAX_INPUTS = 256  # inputs in one request (each is its own engine request)
ENCODINGS = ("float", "base64")
NAMES = FieldNames({"prompt": "input", "prompt_token_ids": "input"})


@dataclass(slots=True)
class EmbeddingsRequest:
    """One parsed body: an engine request per input, and what shapes the response."""

    generates: list[GenerationRequest]
    model: str | None
    encoding_format: str


def _bad(param: str, text: str) -> RequestError:
    return convert.invalid(f"{param}: {text}", param)


def _is_ids(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and bool(value) and all(type(t) is int and 0 <= t < 2**63 for t in value)


def _inputs(body: dict) -> list[str | list[int]]:
    """`input`: a string, a list of strings, a list of token ids, or a list of token-id lists."""
    value = body.get("input")
    inputs: list[str | list[int]]
    if isinstance(value, str) or _is_ids(value):
        inputs = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) or _is_ids(v) for v in value):
        inputs = list(value)
    else:
        raise _bad(
            "input",
            "must be a non-empty string, a list of them, a non-empty list of token ids (non-negative integers), "
            "or a list of such lists",
        )
    if len(inputs) > MAX_INPUTS:
        raise _bad("input", f"{len(inputs)} inputs, more than {MAX_INPUTS} in one request")
    return inputs


def parse_embeddings(raw: bytes | dict, pooler: PoolerConfig | None, hidden_size: int) -> EmbeddingsRequest:
    """Parse and type-check an embeddings body (its bytes, or the JSON object a batch file line holds) against
    the server's pooler (None: the model serves no embeddings); RequestError (INVALID_ARGUMENT) naming the
    parameter."""
    body = raw if isinstance(raw, dict) else json_value(raw)
    if not isinstance(body, dict):
        raise _bad("body", "must be a JSON object")
    model = typed(body, "model", str)
    if pooler is None:
        raise _bad(
            "model",
            "this server's model is generative only and does not serve embeddings (start it with --pooling last or "
            "--pooling mean, or serve an embedding model: docs/user/embeddings.md)",
        )
    typed(body, "user", str)  # accepted for compatibility
    encoding = typed(body, "encoding_format", str) or "float"
    if encoding not in ENCODINGS:
        raise _bad("encoding_format", f"must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
    dimensions = typed(body, "dimensions", int)
    try:
        params = pooler.params(hidden_size, typed(body, "pooling", str), typed(body, "normalize", bool), dimensions)
    except FieldError as e:
        raise _bad(e.field, e.message) from None
    inputs = _inputs(body)
    return EmbeddingsRequest([GenerationRequest(p, pooling=params) for p in inputs], model, encoding)


def process(req: EmbeddingsRequest, inputs: InputProcessor) -> list[ProcessedRequest]:
    """Each input checked and tokenized by the engine's input processor; RequestError naming `input`."""
    try:
        return [inputs.process(g) for g in req.generates]
    except FieldError as e:
        raise convert.field_error(e, NAMES) from None


def response_body(outs: list[RequestOutput], model: str, encoding: str, request_id: str) -> dict[str, Any]:
    """OpenAI's embeddings response (`object: list` of `embedding` objects in input order, with usage)."""
    data = []
    for i, out in enumerate(outs):
        assert out.embedding is not None, "an embedding request's final output carries its embedding"
        vector: Any = out.embedding
        if encoding == "base64":
            vector = base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": vector})
    tokens = sum(o.metrics.num_prompt_tokens for o in outs)
    return {
        "id": request_id,
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def embeddings(front: OpenAIFront, request: Request) -> Response:
    """The route: parse, check, submit as one group, wait (a client that leaves aborts it), answer."""
    streams: list = []
    try:
        front.check_auth(request)
        raw = await read_body(request, front.config.limits.max_body_bytes)
        engine = front.loop.engine
        req = parse_embeddings(raw, engine.engine_config.pooler, engine.config.hidden_size)
        lora = front._model(req.model)
        parsed = await front._off_loop(process, req, front.inputs)
        if front.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "server: shutting down")
        rid = f"embd-{uuid.uuid4().hex}"
        submissions = [
            Submission(
                rid if len(parsed) == 1 else f"{rid}-{i}",
                p.prompt_token_ids,
                p.params,
                p.cache_salt,
                lora,
                pooling=p.pooling,
            )
            for i, p in enumerate(parsed)
        ]
        config = front.config
        streams = front.loop.submit_group(
            submissions, config.max_queued_requests, config.multi_prompt_queue_share, config.backpressure
        )
        inbox = streams[0].inbox
        firsts = await front._unless_disconnected(request, streams, _firsts(inbox, len(streams), NAMES))
        outs = await front._unless_disconnected(request, streams, _finals(inbox, firsts, len(streams), NAMES))
        for out in outs:
            front.metrics.on_finished(out)
        front._count(METHOD, grpc.StatusCode.OK)
        model = front.model_name if lora is None else lora.lora_name
        return JSONResponse(await front._off_loop(response_body, outs, model, req.encoding_format, rid))
    except RequestError as e:
        front._abort(streams)
        front._count(METHOD, e.code)
        return error_response(e.code, e.message, param="model" if e.code == grpc.StatusCode.NOT_FOUND else e.field)
    except Exception as e:  # noqa: BLE001 - this request fails alone, in OpenAI's shape, its pages freed
        front._abort(streams, "failed")
        error = convert.internal_error(f"{METHOD} failed: {type(e).__name__}: {e}", exc_info=True)
        front._count(METHOD, error.code)
        return error_response(error.code, error.message)
