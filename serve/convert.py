"""Between the wire and the engine: request validation and conversion, and engine outputs as messages.

Every rejection is a `RequestError` carrying a gRPC status and a message that starts with the
offending field's name (`sampling.temperature: ...`). Invalid UTF-8 in a `string` field makes protobuf
refuse the whole message at parse time, which grpc would answer with a nameless INTERNAL; the
`lenient_deserializer` re-parses such a message with every string field read as bytes to find the
field and returns an `InvalidRequest` the servicer answers with INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from paged_jax.outputs import CompletionOutput, RequestOutput, TokenLogprob
from paged_jax.sampling_params import SamplingParams
from paged_jax.tokenization.chat_template import ChatTemplateError, apply_chat_template
from serve.config import ServingLimits
from serve.proto.paged_jax.v1 import generate_pb2 as pb

FINISH_REASONS = {
    "eos": pb.FINISH_REASON_EOS,
    "stop": pb.FINISH_REASON_STOP,
    "stop_string": pb.FINISH_REASON_STOP_STRING,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}
MAX_CHARS_PER_TOKEN = 8  # no tokenizer makes fewer tokens than characters / 8
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
)


class RequestError(Exception):
    """A request that ends with `code` and `message` (which names the field for INVALID_ARGUMENT)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


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
    descriptor: Descriptor = message_type.DESCRIPTOR
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


def max_prompt_tokens(limits: ServingLimits, max_model_len: int) -> int:
    """The longest prompt a request may have: the limit, and room for at least one generated token."""
    return min(limits.max_prompt_tokens or max_model_len, max_model_len - 1)


def check_text_length(field: str, text: str, max_tokens: int) -> None:
    """Refuse text that must hold more than `max_tokens` tokens before spending time encoding it."""
    if len(text) > max_tokens * MAX_CHARS_PER_TOKEN:
        raise invalid(f"{field}: longer than the prompt limit of {max_tokens} tokens")


def check_token_ids(field: str, ids: Sequence[int], vocab_size: int) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid(f"{field}: {bad} is not a token id in [0, {vocab_size})")
    return list(ids)


def parse_generate(
    req: pb.GenerateRequest,
    limits: ServingLimits,
    tokenizer,
    vocab_size: int,
    max_model_len: int,
    max_n: int,
    defaults: Mapping[str, Any] | None = None,
) -> ParsedRequest:
    """Validate a GenerateRequest against the limits and the model; tokenize text input, render chat input.

    `defaults` (the model's generation_config.json) fill the sampling fields the request leaves unset.
    """
    if req.output_mode not in pb.OutputMode.values():
        raise invalid(f"output_mode: unknown value {req.output_mode}")
    request_id = req.request_id if req.HasField("request_id") else None
    if request_id is not None and not 0 < len(request_id) <= limits.max_request_id_chars:
        raise invalid(f"request_id: must have 1 to {limits.max_request_id_chars} characters")
    cache_salt = req.cache_salt if req.HasField("cache_salt") else None
    if cache_salt is not None and len(cache_salt) > limits.max_cache_salt_chars:
        raise invalid(f"cache_salt: longer than {limits.max_cache_salt_chars} characters")
    kind = req.WhichOneof("input")
    if kind is None:
        raise invalid("input: set text, token_ids or chat")
    max_prompt = max_prompt_tokens(limits, max_model_len)
    if kind == "text":
        if not req.text:
            raise invalid("text: must not be empty")
        check_text_length("text", req.text, max_prompt)  # bound the input before encoding it
        ids = tokenizer.encode(req.text)
    elif kind == "chat":
        ids = chat_prompt_ids(req.chat, tokenizer, max_prompt)
    else:
        if not req.token_ids.ids:
            raise invalid("token_ids: must not be empty")
        if len(req.token_ids.ids) > max_prompt:  # bound the input before looking at every id
            raise invalid(
                f"token_ids: the prompt has {len(req.token_ids.ids)} tokens, more than the limit of "
                f"{max_prompt} (max_model_len {max_model_len})"
            )
        ids = check_token_ids("token_ids", req.token_ids.ids, vocab_size)
    if len(ids) > max_prompt:
        raise invalid(
            f"{kind}: the prompt has {len(ids)} tokens, more than the limit of {max_prompt} "
            f"(max_model_len {max_model_len})"
        )
    params = _sampling(req.sampling, limits, len(ids), max_model_len, defaults or {})
    try:
        params.validate(vocab_size, min(max_n, limits.max_n))
    except ValueError as e:
        raise invalid(f"sampling.{e}") from None
    return ParsedRequest(request_id, ids, params, cache_salt, req.output_mode)


def _json_field(field: str, text: str, kind: type) -> Any:
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise invalid(f"{field}: not valid JSON ({e.msg})") from None
    if not isinstance(value, kind):
        raise invalid(f"{field}: must be a JSON {'list' if kind is list else 'object'}")
    return value


def chat_prompt_ids(chat: pb.ChatInput, tokenizer, max_prompt: int) -> list[int]:
    """A conversation rendered with the model's chat template and tokenized (INVALID_ARGUMENT naming the field)."""
    messages = []
    for i, m in enumerate(chat.messages):
        if len(m.content) > max_prompt * 8:  # as for text: longer than any prompt the limit allows
            raise invalid(f"chat.messages[{i}].content: longer than the prompt limit of {max_prompt} tokens")
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.HasField("name"):
            message["name"] = m.name
        if m.HasField("tool_call_id"):
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    tools = _json_field("chat.tools_json", chat.tools_json, list)
    extra = _json_field("chat.chat_template_kwargs_json", chat.chat_template_kwargs_json, dict) or {}
    reserved = sorted(set(extra) & {"messages", "tools", "add_generation_prompt"})
    if reserved:
        raise invalid(f"chat.chat_template_kwargs_json: {reserved[0]} is set by its own field")
    add_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    try:
        _, ids = apply_chat_template(
            tokenizer,
            messages,
            add_generation_prompt=add_prompt,
            tools=tools,
            field="chat.messages",
            template_kwargs=extra,
        )
    except ChatTemplateError as e:
        message = str(e)
        raise invalid(message if message.startswith("chat") else f"chat.{message}") from None
    return ids


def _sampling(
    sp: pb.SamplingParams, limits: ServingLimits, prompt_len: int, max_model_len: int, defaults: Mapping[str, Any]
) -> SamplingParams:
    kwargs = {name: getattr(sp, name) for name in _OPTIONAL_SAMPLING if sp.HasField(name)}
    kwargs = {**{k: v for k, v in defaults.items() if k != "max_tokens"}, **kwargs}
    room = max_model_len - prompt_len
    if sp.HasField("max_tokens"):
        if sp.max_tokens > limits.max_tokens:
            raise invalid(f"sampling.max_tokens: {sp.max_tokens} is above the limit of {limits.max_tokens}")
        if sp.max_tokens > room:
            raise invalid(
                f"sampling.max_tokens: prompt ({prompt_len} tokens) + max_tokens ({sp.max_tokens}) "
                f"exceeds max_model_len ({max_model_len})"
            )
        kwargs["max_tokens"] = sp.max_tokens
    else:  # the model's max_new_tokens, else the server's default; never past the limit or the model's length
        kwargs["max_tokens"] = min(defaults.get("max_tokens", limits.default_max_tokens), limits.max_tokens, room)
    if len(sp.stop) > limits.max_stop_strings:
        raise invalid(f"sampling.stop: more than {limits.max_stop_strings} stop strings")
    for s in sp.stop:
        if len(s) > limits.max_stop_string_chars:
            raise invalid(f"sampling.stop: a stop string is longer than {limits.max_stop_string_chars} characters")
    if len(sp.stop_token_ids) > limits.max_stop_token_ids:
        raise invalid(f"sampling.stop_token_ids: more than {limits.max_stop_token_ids} ids")
    return SamplingParams(stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids), **kwargs)


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


def _set_finish(msg: pb.Completion, c: CompletionOutput) -> None:
    if c.finish_reason is not None:
        msg.finish_reason = FINISH_REASONS[c.finish_reason]
    if isinstance(c.stop_reason, str):
        msg.stop_string = c.stop_reason
    elif isinstance(c.stop_reason, int):
        msg.stop_token_id = c.stop_reason


def chunk(c: CompletionOutput, mode: int) -> pb.Completion:
    """The delta of one sample for a stream (empty token_ids/text per `mode`)."""
    msg = pb.Completion(index=c.index, logprobs=_logprobs(c.new_logprobs))
    if mode != pb.OUTPUT_MODE_TEXT:
        msg.token_ids.extend(c.new_token_ids)
    if mode != pb.OUTPUT_MODE_TOKENS:
        msg.text = c.new_text
    _set_finish(msg, c)
    return msg


def full_completion(c: CompletionOutput, mode: int) -> pb.Completion:
    msg = pb.Completion(index=c.index, logprobs=_logprobs(c.logprobs))
    if mode != pb.OUTPUT_MODE_TEXT:
        msg.token_ids.extend(c.token_ids)
    if mode != pb.OUTPUT_MODE_TOKENS:
        msg.text = c.text
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
    return pb.Final(samples=samples, usage=usage(out), timing=timing(out), message=message)


def unary(out: RequestOutput, mode: int, message: str = "") -> pb.GenerateUnaryResponse:
    return pb.GenerateUnaryResponse(
        request_id=out.request_id,
        completions=[full_completion(c, mode) for c in out.outputs],
        usage=usage(out),
        timing=timing(out),
        message=message,
    )
