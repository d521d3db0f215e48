"""The Embed RPC: an EmbedRequest as the engine's pooling requests, and its response.

The same pooling as `POST /v1/embeddings` (`serve.openai_api.embeddings`): the model's pooler
(`paged_jax.config.pooling.PoolerConfig.params`: last-token or mean pooling, normalization, Matryoshka
`dimensions`) with the request's overrides, each input one prefill-only engine request checked by the engine's
input processor, all of them submitted as one group. INVALID_ARGUMENT names the field in the proto's words
(`inputs[1].token_ids`, `dimensions`); a model that serves no embeddings is FAILED_PRECONDITION (the request is
fine, the server is not set up for it).
"""

from __future__ import annotations

import grpc

from paged_jax.engine.input_processor import GenerationRequest, InputProcessor, ProcessedRequest
from paged_jax.engine.protocol import Engine
from paged_jax.errors import FieldError, FieldNames
from paged_jax.outputs import RequestOutput

from . import convert
from .convert import RequestError, invalid
from .openai_api.embeddings import MAX_INPUTS
from .proto.paged_jax.v1 import generate_pb2 as pb


def parse_embed(req: pb.EmbedRequest, engine: Engine, inputs: InputProcessor) -> list[ProcessedRequest]:
    """Each input of `req` as a checked, tokenized pooling request; RequestError naming the field at fault."""
    pooler = engine.engine_config.pooler
    if pooler is None:
        raise RequestError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "Embed: this server's model is generative only and does not serve embeddings (start it with --pooling "
            "last or --pooling mean, or serve an embedding model: docs/user/embeddings.md)",
        )
    if not req.inputs:
        raise invalid("inputs: at least one input is needed", "inputs")
    if len(req.inputs) > MAX_INPUTS:
        raise invalid(f"inputs: {len(req.inputs)} inputs, more than {MAX_INPUTS} in one request", "inputs")
    try:
        params = pooler.params(
            engine.config.hidden_size,
            req.pooling if req.HasField("pooling") else None,
            req.normalize if req.HasField("normalize") else None,
            req.dimensions if req.HasField("dimensions") else None,
        )
    except FieldError as e:
        raise invalid(str(e), e.field) from None
    rid = req.request_id if req.HasField("request_id") else None
    out = []
    for i, item in enumerate(req.inputs):
        kind = item.WhichOneof("input")
        if kind is None:
            raise invalid(f"inputs[{i}]: set text or token_ids", f"inputs[{i}]")
        prompt = item.text if kind == "text" else list(item.token_ids.ids)
        try:
            out.append(inputs.process(GenerationRequest(prompt, request_id=rid, pooling=params)))
        except FieldError as e:
            names = FieldNames({"prompt": f"inputs[{i}].text", "prompt_token_ids": f"inputs[{i}].token_ids"})
            raise convert.field_error(e, names) from None
    return out


def response(outs: list[RequestOutput], request_id: str) -> pb.EmbedResponse:
    """The embeddings in input order, and the inputs' token count."""
    embeddings = []
    for out in outs:
        assert out.embedding is not None, "an embedding request's final output carries its embedding"
        embeddings.append(pb.Embedding(values=out.embedding))
    tokens = sum(o.metrics.num_prompt_tokens for o in outs)
    return pb.EmbedResponse(request_id=request_id, embeddings=embeddings, usage=pb.Usage(prompt_tokens=tokens))
