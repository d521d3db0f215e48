"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) as the engine's `GenerationRequest`.

This module checks JSON types (the engine's input processor then does every other check, the same for
every front), maps OpenAI's names onto ours, and refuses the OpenAI options we do not implement instead of
silently ignoring them. A completions request may carry several prompts: one GenerationRequest each.
`field_names` says how an engine field is called here (`max_tokens` may be `max_completion_tokens`, chat's
`logprobs` count is `top_logprobs`, token-id prompts are `prompt`); every refusal names its parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

from paged_jax.bounded_json import load_json
from paged_jax.engine.input_processor import ChatPrompt, GenerationRequest, check_message_count
from paged_jax.errors import FieldError, FieldNames
from paged_jax.sampling_params import logit_bias_from_json
from paged_jax.tokenization.tool_calls import function_specs, history_tool_calls

from ..convert import RequestError, invalid
from .structured import structured_output

Kind = Literal["completion", "chat"]
_UINT32 = 2**32
MAX_PROMPTS = 64  # prompts in one completions request (each is its own engine request)
_TYPE_NAMES = {
    (str,): "a string",
    (bool,): "a boolean",
    (int,): "an integer",
    (int, float): "a number",
    (dict,): "an object",
    (list,): "an array",
}
# OpenAI / vLLM name -> (our SamplingParams name, JSON type)
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_UINTS = ("n", "min_tokens", "max_reasoning_tokens")
_BOOLS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "speculate")
# Options that change what OpenAI would return and that we do not implement: refused unless at their default.
_UNSUPPORTED: dict[str, dict[str, tuple[Any, ...]]] = {
    "completion": {"suffix": ("",)},
    "chat": {
        "echo": (False,),  # vLLM's chat echo repeats the last message; the completions echo is the one lm-eval uses
        "functions": ([],),
        "function_call": ("none", "auto"),
        "parallel_tool_calls": (True,),
        "audio": (),
        "prediction": (),
        "modalities": (["text"],),
    },
}


@dataclass(slots=True)
class OpenAIRequest:
    """One parsed body: the engine request plus what only shapes the response."""

    kind: Kind
    generates: list[GenerationRequest]  # one per prompt (a completions request may carry several)
    model: str | None
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    logprobs: int | None  # alternatives per token in the response (None: no logprobs)
    max_tokens_name: str  # which name the client used, for error messages
    echo: bool = False  # completions: the prompt (and with logprobs its prompt logprobs) in front of each choice
    prompt_logprobs: int | None = None  # vLLM's extra: each choice's (chat: the response's) `prompt_logprobs`
    structured_param: str | None = None  # the parameter that asked for structured output (response_format, ...)
    tools: list[Any] | None = None  # chat: the tool definitions
    tool_choice: str | dict[str, Any] = "none"  # none | auto | required | {"type": "function", "function": ...}


def field_names(kind: Kind, max_tokens_name: str = "max_tokens", structured_param: str | None = None) -> FieldNames:
    """The engine's field names as this request's client knows them (the table, not the message, decides)."""
    table = {"prompt_token_ids": "prompt", "max_tokens": max_tokens_name}
    if structured_param is not None:  # the engine's `structured_outputs.<kind>` (a grammar it refused)
        table["structured_outputs"] = structured_param
    if kind == "chat":
        table["logprobs"] = "top_logprobs"
    return FieldNames(table)


def _bad(param: str, text: str) -> RequestError:
    return invalid(f"{param}: {text}", param)


def json_value(raw: bytes) -> Any:
    """A body's JSON value, bounded (`paged_jax.bounded_json`); INVALID_ARGUMENT naming where it is at fault."""
    try:
        return load_json(raw, "body")
    except FieldError as e:
        raise invalid(str(e), e.field) from None


def parse_body(raw: bytes | dict, kind: Kind, max_messages: int | None = None) -> OpenAIRequest:
    """Parse and type-check a JSON body (its bytes, or the object the Responses route translated a request into);
    raises RequestError (INVALID_ARGUMENT naming the parameter). A chat of more than `max_messages` messages is
    refused before they are looked at one by one."""
    body = raw if isinstance(raw, dict) else json_value(raw)
    if not isinstance(body, dict):
        raise _bad("body", "must be a JSON object")
    for name, allowed in _UNSUPPORTED[kind].items():
        value = body.get(name)
        if value is not None and value not in allowed:
            raise _bad(name, "not supported by this server" + (f" (only {allowed[0]!r})" if allowed else ""))
    model = typed(body, "model", str)
    typed(body, "user", str)  # accepted for compatibility; the engine has no use for it
    stream = bool(typed(body, "stream", bool))
    options = typed(body, "stream_options", dict)
    if options is not None and not stream:
        raise _bad("stream_options", "only allowed with stream: true")
    include_usage = bool(typed(options or {}, "include_usage", bool, "stream_options.include_usage"))
    max_tokens_name = "max_tokens"
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        max_tokens_name = "max_completion_tokens"
    sampling: dict[str, Any] = {}
    logprobs = _sampling(body, sampling, kind, max_tokens_name)
    echo = bool(typed(body, "echo", bool))
    prompt_logprobs = _prompt_logprobs(body, sampling, stream, echo, logprobs)
    bias = _logit_bias(body)
    if bias is not None:
        sampling["logit_bias"] = bias
    constraint, structured_param = structured_output(body)
    if constraint is not None:
        sampling["structured_outputs"] = constraint
    salt = typed(body, "cache_salt", str)
    prompts = [chat_prompt(body, max_messages)] if kind == "chat" else _prompts(body)
    tools, tool_choice = _tools(body) if kind == "chat" else (None, "none")
    generates = [GenerationRequest(p, dict(sampling), cache_salt=salt) for p in prompts]
    return OpenAIRequest(
        kind,
        generates,
        model,
        stream,
        include_usage,
        logprobs,
        max_tokens_name,
        echo,
        prompt_logprobs,
        structured_param,
        tools,
        tool_choice,
    )


def _prompt_logprobs(body: dict, sp: dict[str, Any], stream: bool, echo: bool, logprobs: int | None) -> int | None:
    """vLLM's `prompt_logprobs` extra (the engine checks its range); echo with `logprobs` asks the engine for as
    many prompt alternatives when the extra is unset, as vLLM does. Returns the extra (None: not asked)."""
    extra = typed(body, "prompt_logprobs", int)
    if extra is not None and stream:
        raise _bad("prompt_logprobs", "not available with stream: true (as in vLLM)")
    wanted = extra if extra is not None else logprobs if echo else None
    if wanted is not None:
        sp["prompt_logprobs"] = wanted
    return extra


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: an object of token id (its decimal text, JSON keys being strings) -> bias; the
    engine checks the ids against the vocabulary, the range [-100, 100] and the number of entries."""
    bias = typed(body, "logit_bias", dict)
    if not bias:
        return None
    try:
        return logit_bias_from_json(bias)
    except FieldError as e:
        raise _bad(e.field, e.message) from None


def _tools(body: dict) -> tuple[list[Any] | None, str | dict[str, Any]]:
    """(tools, tool_choice), checked; tool_choice defaults to auto with tools (none without), as OpenAI's does."""
    tools = typed(body, "tools", list) or None
    if tools is not None:
        try:
            function_specs(tools)
        except ValueError as e:
            raise invalid(str(e), str(e).partition(":")[0]) from None
    choice = body.get("tool_choice")
    if choice is None:
        return tools, "auto" if tools else "none"
    named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
    if not (choice in ("none", "auto", "required") or named):
        raise _bad("tool_choice", "must be none, auto, required or {'type': 'function', 'function': {'name': ...}}")
    if choice != "none" and tools is None:
        raise _bad("tool_choice", "needs tools")
    if named and choice["function"].get("name") not in function_specs(tools):
        raise _bad("tool_choice.function.name", f"{choice['function'].get('name')!r} is not one of the tools")
    return tools, choice


def typed(body: dict, name: str, kind: type | tuple[type, ...], param: str | None = None) -> Any:
    """body[name] if it has the JSON type `kind` (null counts as unset); a bool is never a number."""
    value = body.get(name)
    if value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        value = object()  # refused below
    if not isinstance(value, kinds):
        raise _bad(param or name, f"must be {_TYPE_NAMES[kinds]}")
    return value


def _uint(body: dict, name: str, bound: int = _UINT32, param: str | None = None) -> int | None:
    value = typed(body, name, int, param)
    if value is not None and not 0 <= value < bound:
        raise _bad(param or name, f"must be an integer in [0, {bound})")
    return value


def _is_ids(value: Any) -> TypeGuard[list[int]]:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _prompts(body: dict) -> list[str | list[int]]:
    """`prompt`: a string, a list of token ids, or a list of several of either (one engine request each)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise _bad("prompt", f"{len(prompt)} prompts, more than {MAX_PROMPTS} in one request")
        prompts = list(prompt)
    else:
        raise _bad("prompt", "must be a string, a non-empty list of token ids, or a list of several of either")
    for p in prompts:
        if not isinstance(p, str) and not all(0 <= t < 2**63 for t in p):
            raise _bad("prompt", "token ids must be non-negative")
    return prompts


def chat_prompt(body: dict, max_messages: int | None = None) -> ChatPrompt:
    """`messages` (and the template options beside them) as the engine's ChatPrompt; RequestError naming the field.
    More than `max_messages` messages are refused before they are looked at one by one."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty array of messages")
    try:
        check_message_count(len(messages), max_messages)
    except FieldError as e:
        raise invalid(str(e), e.field) from None
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, "must be an object with role and content")
        calls = None
        if m.get("tool_calls"):
            try:
                calls = history_tool_calls(m["tool_calls"], f"{where}.tool_calls")
            except FieldError as e:
                raise invalid(str(e), e.field) from None
        role = typed(m, "role", str, f"{where}.role")
        content = m.get("content")
        if content is None and calls:
            content = ""
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"{where}.content[{j}]", "only text parts ({'type': 'text', 'text': ...}) are supported")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise _bad(f"{where}.content", "must be a string or an array of text parts")
        message = {"role": role or "", "content": content}
        if calls:
            message["tool_calls"] = calls
        for key in ("name", "tool_call_id"):
            value = typed(m, key, str, f"{where}.{key}")
            if value is not None:
                message[key] = value
        out.append(message)
    tools = typed(body, "tools", list) or None
    kwargs = typed(body, "chat_template_kwargs", dict) or {}
    add = typed(body, "add_generation_prompt", bool)
    return ChatPrompt(out, True if add is None else add, tools, kwargs)


def _sampling(body: dict, sp: dict[str, Any], kind: Kind, max_tokens_name: str) -> int | None:
    """Copy the sampling fields into `sp` (by our names); returns the number of logprob alternatives the
    response wants (or None)."""
    for name in _FLOATS:
        value = typed(body, name, (int, float))
        if value is not None:
            sp[name] = float(value)
    for name in _UINTS:
        value = _uint(body, name)
        if value is not None:
            sp[name] = value
    for name in _BOOLS:
        value = typed(body, name, bool)
        if value is not None:
            sp[name] = value
    top_k = typed(body, "top_k", int)
    if top_k is not None:
        if not -1 <= top_k < 2**31:
            raise _bad("top_k", "must be -1, 0 (both disable it) or a positive integer")
        sp["top_k"] = top_k
    max_tokens = _uint(body, max_tokens_name)
    if max_tokens is not None:
        if max_tokens < 1 and kind == "chat":  # completions take 0: the prompt only (scoring)
            raise _bad(max_tokens_name, f"must be >= 1, got {max_tokens}")
        sp["max_tokens"] = max_tokens
    seed = typed(body, "seed", int)
    if seed is not None:
        if not 0 <= seed < 2**63:
            raise _bad("seed", f"must be an integer in [0, 2^63), got {seed}")
        sp["seed"] = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("stop", "must be a string or an array of strings")
        if stop:
            sp["stop"] = list(stop)
    stop_ids = typed(body, "stop_token_ids", list)
    if stop_ids:
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63 for t in stop_ids):
            raise _bad("stop_token_ids", "must be an array of token ids")
        sp["stop_token_ids"] = list(stop_ids)
    best_of = _uint(body, "best_of")
    if best_of is not None and best_of != sp.get("n", 1):
        raise _bad("best_of", "only best_of == n is supported")
    if kind == "completion":
        logprobs = _uint(body, "logprobs")
    else:
        top = _uint(body, "top_logprobs")
        wanted = typed(body, "logprobs", bool)
        if top is not None and not wanted:
            raise _bad("top_logprobs", "needs logprobs: true")
        logprobs = (top or 0) if wanted else None
    if logprobs is not None:
        sp["logprobs"] = logprobs
    return logprobs
