"""A small synchronous client for the GenerationService (and `paged-jax client`)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .proto.paged_jax.v1 import generate_pb2 as pb
from .proto.paged_jax.v1 import generate_pb2_grpc as pb_grpc


def chat_input(
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> pb.ChatInput:
    """A ChatInput from `[{"role": ..., "content": ...}, ...]` (optional `name`, `tool_call_id` per message)."""
    chat = pb.ChatInput(messages=[pb.ChatMessage(**m) for m in messages], add_generation_prompt=add_generation_prompt)
    if tools is not None:
        chat.tools_json = json.dumps(list(tools))
    if chat_template_kwargs:
        chat.chat_template_kwargs_json = json.dumps(dict(chat_template_kwargs))
    return chat


def build_request(
    prompt: str | Sequence[int] | pb.ChatInput,
    *,
    request_id: str | None = None,
    cache_salt: str | None = None,
    output_mode: pb.OutputMode = pb.OUTPUT_MODE_UNSPECIFIED,
    lora_name: str | None = None,
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest from text, token ids or a ChatInput (see `chat_input`); `sampling` keywords are
    SamplingParams fields (unset: the model's generation defaults, then the server's)."""
    req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), output_mode=output_mode)
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, pb.ChatInput):
        req.chat.CopyFrom(prompt)
    else:
        req.token_ids.ids.extend(prompt)
    if request_id is not None:
        req.request_id = request_id
    if cache_salt is not None:
        req.cache_salt = cache_salt
    if lora_name is not None:
        req.lora_name = lora_name
    return req


class Client:
    """`Client("127.0.0.1:50051")`; TLS with `root_certificates` (PEM bytes), auth with `token`."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        tls: bool = False,
        server_name: str | None = None,
    ) -> None:
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        if tls or root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = grpc.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate_stream(
        self,
        prompt: str | Sequence[int] | pb.ChatInput | pb.GenerateRequest,
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Iterator[pb.GenerateResponse]:
        """Stream responses (chunks, then one final). Cancel with `.cancel()` on the returned call."""
        req = prompt if isinstance(prompt, pb.GenerateRequest) else build_request(prompt, **kwargs)
        return self.stub.Generate(req, timeout=timeout, metadata=self.metadata)

    def generate(
        self,
        prompt: str | Sequence[int] | pb.ChatInput | pb.GenerateRequest,
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> pb.GenerateUnaryResponse:
        req = prompt if isinstance(prompt, pb.GenerateRequest) else build_request(prompt, **kwargs)
        return self.stub.GenerateUnary(req, timeout=timeout, metadata=self.metadata)

    def model_info(self, timeout: float | None = 10.0) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        timeout: float | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> pb.GenerateUnaryResponse:
        """One reply to a conversation, rendered by the server with the model's chat template."""
        chat = chat_input(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.generate(build_request(chat, **kwargs), timeout=timeout)

    def embed(
        self, inputs: Sequence[str | Sequence[int]], *, timeout: float | None = None, **fields: Any
    ) -> pb.EmbedResponse:
        """Embeddings of texts or token-id lists; `fields`: EmbedRequest's `dimensions`, `normalize`, `pooling`,
        `request_id`."""
        items = [
            pb.EmbedInput(text=x) if isinstance(x, str) else pb.EmbedInput(token_ids=pb.TokenIds(ids=x)) for x in inputs
        ]
        return self.stub.Embed(pb.EmbedRequest(inputs=items, **fields), timeout=timeout, metadata=self.metadata)

    def tokenize(self, text: str, add_special_tokens: bool = True, timeout: float | None = 10.0) -> list[int]:
        req = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self.stub.Tokenize(req, timeout=timeout, metadata=self.metadata).token_ids)

    def detokenize(
        self,
        token_ids: Sequence[int],
        timeout: float | None = 10.0,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        req = pb.DetokenizeRequest(
            token_ids=token_ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )
        return self.stub.Detokenize(req, timeout=timeout, metadata=self.metadata).text

    def stats(self, check_invariants: bool = False, timeout: float | None = 10.0) -> pb.Stats:
        req = pb.GetStatsRequest(check_invariants=check_invariants)
        return self.stub.GetStats(req, timeout=timeout, metadata=self.metadata)

    def kv_events(self, timeout: float | None = None) -> Iterator[pb.KVEventBatch]:
        """The server's KV event batches from now on (`StreamKVEvents`); `.cancel()` the returned call to stop."""
        return self.stub.StreamKVEvents(pb.StreamKVEventsRequest(), timeout=timeout, metadata=self.metadata)

    def health(self, service: str = "", timeout: float | None = 5.0) -> int:
        """The grpc.health.v1 status (health_pb2.HealthCheckResponse.SERVING, NOT_SERVING, ...)."""
        req = health_pb2.HealthCheckRequest(service=service)
        # types-grpcio-health-checking's HealthStub lacks the methods its __init__ sets (Check, Watch)
        return self.health_stub.Check(req, timeout=timeout, metadata=self.metadata).status  # type: ignore[attr-defined]
