"""Between the wire and the engine: request validation and conversion, and engine outputs as messages.

Every rejection is a `RequestError` carrying a gRPC status and a message that starts with the
offending field's name (`sampling.temperature: ...`). Invalid UTF-8 in a `string` field makes protobuf
refuse the whole message at parse time, which grpc would answer with a nameless INTERNAL; the
`lenient_deserializer` re-parses such a message with every string field read as bytes to find the
field and returns an `InvalidRequest` the servicer answers with INVALID_ARGUMENT.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from paged_jax.bounded_json import load_json
from paged_jax.engine.input_processor import (
    MAX_CHARS_PER_TOKEN,
    ChatPrompt,
    GenerationRequest,
    InputProcessor,
    check_message_count,
)
from paged_jax.engine.protocol import Engine
from paged_jax.errors import FieldError, FieldNames
from paged_jax.outputs import CompletionOutput, RequestOutput, TokenLogprob
from paged_jax.sampling_params import SamplingParams, StructuredOutputs
from paged_jax.structured import Matcher
from paged_jax.tokenization.reasoning import ReplySplit, Thought
from paged_jax.tokenization.tool_calls import history_tool_calls

from .config import ServingLimits
from .proto.paged_jax.v1 import generate_pb2 as pb

FINISH_REASONS = {
    "eos": pb.FINISH_REASON_EOS,
    "stop": pb.FINISH_REASON_STOP,
    "stop_string": pb.FINISH_REASON_STOP_STRING,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}
_OPTIONAL_SAMPLING = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "min_tokens",
    "ignore_eos",
    "n",
    "logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "speculate",
    "prompt_logprobs",
    "max_reasoning_tokens",
)


class RequestError(Exception):
    """A request that ends with `code` and `message`; for INVALID_ARGUMENT the message starts with the field at
    fault, and `field` names it (in the front's words) when the front reports it apart (OpenAI's `param`)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.field = code, message, field


def invalid(message: str, field: str | None = None) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message, field)


def field_error(e: FieldError, names: FieldNames) -> RequestError:
    """INVALID_ARGUMENT for a field the engine refused, named in a front's words (`names`)."""
    renamed = e.renamed(names)
    return invalid(str(renamed), renamed.field)


def internal_error(what: str, exc_info: bool = False) -> RequestError:
    """INTERNAL for a client, with an id and nothing else: the cause (exception text, paths, internals) goes
    to the server's log under that id, where an operator can find it."""
    error_id = uuid.uuid4().hex[:12]
    logging.getLogger("serve").error("%s [error id %s]", what, error_id, exc_info=exc_info)
    return RequestError(grpc.StatusCode.INTERNAL, f"internal error (id {error_id}); the server log has the details")


@dataclass(slots=True, frozen=True)
class InvalidRequest:
    """What `lenient_deserializer` returns for bytes that are not a valid request message."""

    message: str


@dataclass(slots=True)
class ParsedRequest:
    request_id: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    output_mode: int
    lora_name: str | None = None  # a served LoRA adapter (the servicer resolves it: NOT_FOUND when unknown)
    thought: Thought | None = None  # a thinking model's reply (`ProcessedRequest.thought`): constraints apply after it
    matchers: list[Matcher] | None = None  # structured outputs, compiled here (`ProcessedRequest.matchers`)
    chat: bool = False  # a chat input: a thinking model's replies are split into reasoning_content and text

    def reply_split(self) -> ReplySplit | None:
        """How this request's replies are split into reasoning and answer (None: they are not)."""
        return ReplySplit(self.thought) if self.chat and self.thought is not None else None


# -- parsing ----------------------------------------------------------------------------------------
def _bytes_twin_pool(file_descriptor) -> descriptor_pool.DescriptorPool:
    """A private pool holding a copy of the file whose `string` fields are `bytes` (same wire format)."""
    proto = descriptor_pb2.FileDescriptorProto()
    file_descriptor.CopyToProto(proto)

    def retype(messages) -> None:
        for msg in messages:
            for f in msg.field:
                if f.type == FieldDescriptor.TYPE_STRING:
                    f.type = FieldDescriptor.TYPE_BYTES
            retype(msg.nested_type)

    retype(proto.message_type)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return pool


_TWIN_POOL = _bytes_twin_pool(pb.DESCRIPTOR)


def _first_bad_utf8(msg: Message, prefix: str = "") -> str | None:
    """The path of the first bytes field (a `string` on the real message) that is not valid UTF-8."""
    for field, value in msg.ListFields():
        path = f"{prefix}{field.name}"
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for i, sub in enumerate(value if _is_repeated(field) else [value]):
                found = _first_bad_utf8(sub, f"{path}[{i}]." if _is_repeated(field) else f"{path}.")
                if found:
                    return found
        elif field.type == FieldDescriptor.TYPE_BYTES:
            for i, item in enumerate(value if _is_repeated(field) else [value]):
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError:
                    return f"{path}[{i}]" if _is_repeated(field) else path
    return None


def _is_repeated(field: FieldDescriptor) -> bool:
    return field.is_repeated


def lenient_deserializer(message_type: type[Message]) -> Callable[[bytes], Message | InvalidRequest]:
    """A request deserializer that turns parse failures into an `InvalidRequest` naming the field."""
    descriptor = message_type.DESCRIPTOR
    twin = message_factory.GetMessageClass(_TWIN_POOL.FindMessageTypeByName(descriptor.full_name))

    def deserialize(data: bytes) -> Message | InvalidRequest:
        try:
            return message_type.FromString(data)
        except DecodeError:
            pass
        try:
            field = _first_bad_utf8(twin.FromString(data))
        except DecodeError:
            field = None
        if field is not None:
            return InvalidRequest(f"{field}: is not valid UTF-8")
        return InvalidRequest(f"request: not a valid {descriptor.full_name} message")

    return deserialize


def check_text_length(field: str, text: str, max_tokens: int) -> None:
    """Refuse text that must hold more than `max_tokens` tokens before spending time encoding it."""
    if len(text) > max_tokens * MAX_CHARS_PER_TOKEN:
        raise invalid(f"{field}: longer than the prompt limit of {max_tokens} tokens")


def check_token_ids(field: str, ids: Sequence[int], vocab_size: int) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid(f"{field}: {bad} is not a token id in [0, {vocab_size})")
    return list(ids)


# How the gRPC messages name the engine's fields (`paged_jax.engine.input_processor`); sampling fields are
# `sampling.<name>`.
GRPC_FIELDS = FieldNames(
    {
        "prompt": "text",
        "prompt_token_ids": "token_ids",
        "messages": "chat.messages",
        "tools": "chat.tools_json",
        "chat_template_kwargs": "chat.chat_template_kwargs_json",
        "add_generation_prompt": "chat.add_generation_prompt",
        "chat_template": "chat_template",
        "request_id": "request_id",
        "cache_salt": "cache_salt",
        "structured_outputs": "sampling.structured_output",  # the proto's oneof
    },
    prefix="sampling.",
)


def serving_inputs(engine: Engine, limits: ServingLimits) -> InputProcessor:
    """The input processor of a server's requests: the engine's model and generation defaults, the limits."""
    return InputProcessor(
        engine.tokenizer,
        vocab_size=engine.config.vocab_size,
        max_model_len=engine.max_model_len,
        max_n=engine.max_n,
        defaults=dict(engine.engine_config.sampling_defaults),
        limits=limits.input_limits(),
        max_logit_bias=engine.engine_config.max_logit_bias,
        reasoning_parser=engine.engine_config.reasoning_parser,
        grammars=engine.compile_matchers,  # on the front's threads: the engine thread never compiles a grammar
        hidden_size=engine.config.hidden_size,
    )


def parse_generate(req: pb.GenerateRequest, inputs: InputProcessor) -> ParsedRequest:
    """A GenerateRequest as the engine's `GenerationRequest`, checked by the input processor (`serving_inputs`:
    limits, model, generation defaults; text tokenized, chat rendered); INVALID_ARGUMENT names the field in
    the proto's words."""
    if req.output_mode not in pb.OutputMode.values():
        raise invalid(f"output_mode: unknown value {req.output_mode}")
    kind = req.WhichOneof("input")
    if kind is None:
        raise invalid("input: set text, token_ids or chat")
    try:
        if kind == "chat":
            check_message_count(len(req.chat.messages), inputs.limits.max_chat_messages)
    except FieldError as e:
        raise field_error(e, GRPC_FIELDS) from None
    prompt = req.text if kind == "text" else chat_prompt(req.chat) if kind == "chat" else list(req.token_ids.ids)
    request = GenerationRequest(
        prompt,
        sampling_fields(req.sampling),
        request_id=req.request_id if req.HasField("request_id") else None,
        cache_salt=req.cache_salt if req.HasField("cache_salt") else None,
    )
    try:
        p = inputs.process(request)
        inputs.check_size([p])
    except FieldError as e:
        raise field_error(e, GRPC_FIELDS) from None
    lora = req.lora_name if req.HasField("lora_name") else None
    return ParsedRequest(
        p.request_id,
        p.prompt_token_ids,
        p.params,
        p.cache_salt,
        req.output_mode,
        lora,
        p.thought,
        p.matchers,
        chat=kind == "chat",
    )


def _json_field(field: str, text: str, kind: type) -> Any:
    if not text:
        return None
    try:
        value = load_json(text, field)
    except FieldError as e:
        raise invalid(str(e), e.field) from None
    if not isinstance(value, kind):
        raise invalid(f"{field}: must be a JSON {'list' if kind is list else 'object'}")
    return value


def chat_prompt(chat: pb.ChatInput) -> ChatPrompt:
    """A ChatInput as the engine's `ChatPrompt` (its JSON fields parsed: INVALID_ARGUMENT naming them)."""
    messages: list[dict[str, Any]] = []
    for m in chat.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.HasField("name"):
            message["name"] = m.name
        if m.HasField("tool_call_id"):
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls_json:
            field = f"chat.messages[{len(messages)}].tool_calls_json"
            try:
                message["tool_calls"] = history_tool_calls(_json_field(field, m.tool_calls_json, list), field)
            except FieldError as e:
                raise invalid(str(e), e.field) from None
        messages.append(message)
    tools = _json_field("chat.tools_json", chat.tools_json, list)
    extra = _json_field("chat.chat_template_kwargs_json", chat.chat_template_kwargs_json, dict) or {}
    add_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return ChatPrompt(messages, add_prompt, tools, extra)


def sampling_fields(sp: pb.SamplingParams) -> dict[str, Any]:
    """The sampling fields a request set (the proto's optional fields that are present, non-empty lists)."""
    fields = {name: getattr(sp, name) for name in _OPTIONAL_SAMPLING if sp.HasField(name)}
    if sp.HasField("max_tokens"):
        fields["max_tokens"] = sp.max_tokens
    if sp.stop:
        fields["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        fields["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.logit_bias:
        fields["logit_bias"] = dict(sp.logit_bias)
    if sp.HasField("structured_output"):
        fields["structured_outputs"] = structured_outputs(sp.structured_output)
    return fields


def structured_outputs(so: pb.StructuredOutput) -> StructuredOutputs:
    """The engine's `StructuredOutputs` of a `StructuredOutput` message (INVALID_ARGUMENT naming the field for
    what the message itself gets wrong; the engine's grammar compile checks the rest, and bounds its size)."""
    kind = so.WhichOneof("kind")
    field = f"sampling.structured_output.{kind}"
    if kind is None:
        raise invalid("sampling.structured_output: set one of json_schema, json_object, regex, choice, grammar")
    value = getattr(so, kind)
    if kind == "json_object":
        if not value:
            raise invalid(f"{field}: must be true when set", field)
        return StructuredOutputs(json=True)
    if kind == "json_schema":
        return StructuredOutputs(json=_json_field(field, value, dict) or {})
    if kind == "structural_tag":
        return StructuredOutputs(structural_tag=_json_field(field, value, dict) or {})
    if kind == "choice":
        return StructuredOutputs(choice=list(value.choices))
    return StructuredOutputs(**{kind: value})


# -- outputs ----------------------------------------------------------------------------------------
def _logprobs(items: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    if not items:
        return []
    return [
        pb.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
        )
        for lp in items
    ]


def _prompt_logprobs(out: RequestOutput) -> list[pb.TokenLogprob]:
    """The prompt logprobs after the first token's (which has none), when the request asked for them."""
    if not out.prompt_logprobs:
        return []
    return _logprobs([lp for lp in out.prompt_logprobs[1:] if lp is not None])  # only the first token has none


def _set_finish(msg: pb.Completion, c: CompletionOutput) -> None:
    if c.finish_reason is not None:
        msg.finish_reason = FINISH_REASONS[c.finish_reason]
    if isinstance(c.stop_reason, str):
        msg.stop_string = c.stop_reason
    elif isinstance(c.stop_reason, int):
        msg.stop_token_id = c.stop_reason


def chunk(c: CompletionOutput, mode: int, split: ReplySplit | None = None) -> pb.Completion:
    """The delta of one sample for a stream (empty token_ids/text per `mode`); with `split`, its thought goes
    to reasoning_content (text always runs through it, so a tag cut across deltas is held back either way)."""
    msg = pb.Completion(index=c.index, logprobs=_logprobs(c.new_logprobs))
    if mode != pb.OUTPUT_MODE_TEXT:
        msg.token_ids.extend(c.new_token_ids)
    reasoning, text = split.delta(c.index, c.new_text, c.finished) if split is not None else ("", c.new_text)
    if mode != pb.OUTPUT_MODE_TOKENS:
        msg.text, msg.reasoning_content = text, reasoning
    _set_finish(msg, c)
    return msg


def full_completion(c: CompletionOutput, mode: int, split: ReplySplit | None = None) -> pb.Completion:
    msg = pb.Completion(index=c.index, logprobs=_logprobs(c.logprobs))
    if mode != pb.OUTPUT_MODE_TEXT:
        msg.token_ids.extend(c.token_ids)
    if mode != pb.OUTPUT_MODE_TOKENS:
        reasoning, msg.text = split.whole(c.text) if split is not None else ("", c.text)
        msg.reasoning_content = reasoning
    _set_finish(msg, c)
    return msg


def usage(out: RequestOutput) -> pb.Usage:
    m = out.metrics
    return pb.Usage(
        prompt_tokens=m.num_prompt_tokens,
        completion_tokens=m.num_generated_tokens,
        cached_tokens=m.num_cached_prompt_tokens,
    )


def timing(out: RequestOutput) -> pb.Timing:
    m = out.metrics
    e2e = (m.finish_time - m.arrival_time) if m.finish_time is not None else 0.0
    return pb.Timing(
        time_to_first_token_s=m.time_to_first_token or 0.0,
        time_per_output_token_s=m.time_per_output_token or 0.0,
        e2e_s=e2e,
    )


def final(out: RequestOutput, message: str = "") -> pb.Final:
    samples = []
    for c in out.outputs:
        s = pb.Completion(index=c.index)
        _set_finish(s, c)
        samples.append(s)
    return pb.Final(
        samples=samples,
        usage=usage(out),
        timing=timing(out),
        message=message,
        prompt_logprobs=_prompt_logprobs(out),
    )


def unary(
    out: RequestOutput, mode: int, message: str = "", split: ReplySplit | None = None
) -> pb.GenerateUnaryResponse:
    return pb.GenerateUnaryResponse(
        request_id=out.request_id,
        completions=[full_completion(c, mode, split) for c in out.outputs],
        usage=usage(out),
        timing=timing(out),
        message=message,
        prompt_logprobs=_prompt_logprobs(out),
    )
