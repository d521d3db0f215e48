"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat-completions path.

A Responses request is translated into the chat path's body (`to_chat`) and run by the same code as
`/v1/chat/completions` (`protocol.parse_body`, the chat template, structured output, the tool-call and reasoning
parsers, `OpenAIFront.start`); its chat result is translated back (`output_items`, `ResponseEvents`):
- `input`: a string (one user message) or items: messages (`role` user / system / developer (as system) /
  assistant, `content` a string or `input_text` / `output_text` parts), `function_call` items (an assistant
  message's tool calls; consecutive ones, and an assistant message just before them, make one message) and
  `function_call_output` items (tool messages). `reasoning` items given back are dropped: chat templates render
  past turns' answers, not their thoughts. `instructions`: a system message in front, for this request only.
- `tools`: function tools in the flat shape `{type: function, name, description, parameters, strict}`;
  `tool_choice`: auto / required / none / `{type: function, name}` (forced calls are grammar-constrained, on
  every model, as chat's are). `text.format`: `text`, `json_schema` (`name`, `schema`, `strict`) or
  `json_object`. `max_output_tokens`, `temperature`, `top_p`, and the chat path's sampling extras (`_EXTRAS`).
- Output: a `reasoning` item when the reply has a thought (its text as a `reasoning_text` part), a `message`
  item with one `output_text` part (left out when the reply is only tool calls), a `function_call` item per call.
  `status` "incomplete" (reason `max_output_tokens`) when the reply ran out of tokens.
- `stream: true`: the documented semantic events, each with `type` and `sequence_number`, in order.
- `store` (default true): the response and its conversation are kept in a bounded in-memory LRU
  (`ResponseStore`, `MAX_STORED` responses); `previous_response_id` continues such a conversation (an unknown
  or evicted id: 404 naming it); `store: false` keeps nothing.
Parameters this route does not implement (`_DEFAULT_ONLY`, and any name it does not know) are refused naming
them, never ignored.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from paged_jax.outputs import RequestOutput

from .. import convert
from ..convert import RequestError
from .body import read_body
from .errors import error_body, error_response
from .front import OpenAIFront, Run, _EventStream
from .protocol import json_value, parse_body, typed

METHOD = "OpenAI.Responses"
MAX_STORED = 1024  # responses kept for previous_response_id / GET (least recently used evicted first)
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# The chat path's sampling extras, passed on as they are (vLLM's Responses route takes them too).
_EXTRAS = (
    "top_k",
    "min_p",
    "seed",
    "stop",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
    "max_reasoning_tokens",
    "chat_template_kwargs",
    "cache_salt",
)
_ACCEPTED = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "reasoning",
    "store",
    "previous_response_id",
    "stream",
    "metadata",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "service_tier",
}
# OpenAI parameters not implemented here: accepted only at these values (an empty tuple: never).
_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "truncation": ("disabled",),
    "include": ([],),
    "parallel_tool_calls": (True,),
    "top_logprobs": (0,),
    "max_tool_calls": (),
    "prompt": (),
    "conversation": (),
    "stream_options": (),
}
_RENAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def _bad(param: str, text: str) -> RequestError:
    return convert.invalid(f"{param}: {text}", param)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- the store ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Stored:
    """A stored response and its conversation as chat messages (its input, then its output; no instructions)."""

    response: dict[str, Any]
    history: list[dict[str, Any]]


class ResponseStore:
    """The responses kept for `previous_response_id` and GET, at most `capacity`, least recently used evicted
    first. Read by the front's parsing threads and written by the event loop's, so a lock guards it."""

    def __init__(self, capacity: int = MAX_STORED) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, stored: Stored) -> None:
        with self._lock:
            self._items[stored.response["id"]] = stored
            self._items.move_to_end(stored.response["id"])
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


def _unknown(response_id: str, param: str | None) -> RequestError:
    where = f"{param}: " if param else ""
    return RequestError(
        grpc.StatusCode.NOT_FOUND,
        f"{where}no stored response with id {response_id!r} (never stored, stored with store: false, deleted, or "
        "evicted)",
        param,
    )


# -- the request --------------------------------------------------------------------------------------
@dataclass(slots=True)
class ResponsesRequest:
    """One parsed Responses body: the chat body it runs as, the conversation it continues, and what the Response
    object repeats of the request."""

    chat: dict[str, Any]  # the chat-completions body
    history: list[dict[str, Any]]  # the conversation as chat messages, without the instructions
    stream: bool
    store: bool
    echoed: dict[str, Any]  # the request's fields as the Response object repeats them


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (`input_text`, `output_text`) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or an array of input_text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}]", "only text parts ({'type': 'input_text', 'text': ...}) are supported")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (name != "arguments" and not value):
        raise _bad(f"{where}.{name}", "must be a non-empty string" if name != "arguments" else "must be a string")
    return value


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages (the module docstring lists the items); RequestError naming the item at fault."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input", "must be a string or a non-empty array of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, "must be an object (a message, function_call or function_call_output item)")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _bad(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
            content = _text(item.get("content"), f"{where}.content")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output})
        elif kind == "reasoning":
            continue  # past thoughts: chat templates render the answers of past turns only
        else:
            raise _bad(
                f"{where}.type",
                f"unknown item type {kind!r} (message, function_call, function_call_output and reasoning are "
                "supported)",
            )
    return out


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's `{type: function, function: {...}}`."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad("tools", "must be an array of function tools")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(where, "must be an object {'type': 'function', 'name': ..., 'parameters': {...}}")
        if tool.get("type") != "function":
            raise _bad(f"{where}.type", f"{tool.get('type')!r} tools are not supported here (function tools only)")
        fn: dict[str, Any] = {"name": _string(tool, "name", where)}
        parameters = tool.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise _bad(f"{where}.parameters", "must be a JSON Schema object")
            fn["parameters"] = parameters
        description = typed(tool, "description", str, f"{where}.description")
        if description is not None:
            fn["description"] = description
        typed(tool, "strict", bool, f"{where}.strict")  # forced calls follow the schema in any case
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, Any] | None:
    if value is None or value in ("auto", "none", "required"):
        return value
    if not (isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str)):
        raise _bad("tool_choice", "must be auto, none, required or {'type': 'function', 'name': ...}")
    names = [t["function"]["name"] for t in tools or ()]
    if value["name"] not in names:
        raise _bad("tool_choice.name", f"{value['name']!r} is not one of the tools")
    return {"type": "function", "function": {"name": value["name"]}}


def _text_format(value: Any) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("text", "must be an object {'format': {...}}")
    for key in value:
        if key not in ("format", "verbosity"):
            raise _bad(f"text.{key}", "not supported by this server")
    if value.get("verbosity") not in (None, "medium"):
        raise _bad("text.verbosity", "not supported by this server (only 'medium')")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format", "must be an object with a type")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise _bad("text.format.schema", "must be a JSON Schema object")
        name = typed(fmt, "name", str, "text.format.name") or "response"
        spec = {"name": name, "schema": schema, "strict": bool(typed(fmt, "strict", bool, "text.format.strict"))}
        return {"type": "json_schema", "json_schema": spec}
    raise _bad("text.format.type", f"must be text, json_schema or json_object, got {kind!r}")


def to_chat(raw: bytes, store: ResponseStore) -> ResponsesRequest:
    """Parse and check a Responses body and translate it into the chat path's body; RequestError naming the
    parameter (an unknown `previous_response_id`: NOT_FOUND)."""
    body = json_value(raw)
    if not isinstance(body, dict):
        raise _bad("body", "must be a JSON object")
    for name, value in body.items():
        if name in _DEFAULT_ONLY:
            allowed = _DEFAULT_ONLY[name]
            if value is not None and value not in allowed:
                raise _bad(name, "not supported by this server" + (f" (only {allowed[0]!r})" if allowed else ""))
        elif name not in _ACCEPTED and name not in _EXTRAS:
            raise _bad(name, "unknown parameter")
    for name in ("user", "safety_identifier", "prompt_cache_key", "service_tier"):
        typed(body, name, str)  # accepted for compatibility; the engine has no use for them
    reasoning = typed(body, "reasoning", dict) or {}
    for key, value in reasoning.items():
        if value is not None:
            raise _bad(
                f"reasoning.{key}",
                "not supported by this server (a thinking model's thought comes as a reasoning item; "
                "max_reasoning_tokens bounds it, chat_template_kwargs turns it off)",
            )
    metadata = typed(body, "metadata", dict)
    keep = typed(body, "store", bool)
    keep = True if keep is None else keep
    previous = typed(body, "previous_response_id", str)
    history: list[dict[str, Any]] = []
    if previous is not None:
        stored = store.get(previous)
        if stored is None:
            raise _unknown(previous, "previous_response_id")
        history = list(stored.history)
    history += input_messages(body.get("input"))
    instructions = typed(body, "instructions", str)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    chat: dict[str, Any] = {"messages": messages, "model": typed(body, "model", str)}
    if tools is not None:
        chat["tools"] = tools
    if choice is not None:
        chat["tool_choice"] = choice
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    for name in _EXTRAS:
        if body.get(name) is not None:
            chat[name] = body[name]
    stream = bool(typed(body, "stream", bool))
    echoed = {
        "instructions": instructions,
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": previous,
        "store": keep,
        "metadata": metadata or {},
        "parallel_tool_calls": True,
        "truncation": "disabled",
        "reasoning": {"effort": None, "summary": None},
    }
    return ResponsesRequest(chat, history, stream, keep, echoed)


def _rename(param: str | None) -> str | None:
    """A chat parameter's name as this route's client knows it."""
    if param is None:
        return None
    head, sep, rest = param.partition(".")
    base = head.partition("[")[0]
    if base == "tools" and rest.startswith("function."):
        return f"{head}.{rest.removeprefix('function.')}"
    if base in _RENAMES:
        return _RENAMES[base] if base == "messages" else _RENAMES[base] + head[len(base) :] + sep + rest
    return param


def _renamed(e: RequestError) -> RequestError:
    """A chat-path refusal in this route's words (its param, and the message that starts with it)."""
    name = _rename(e.field)
    if e.field is None or name is None or name == e.field:
        return e
    message = name + e.message[len(e.field) :] if e.message.startswith(e.field) else e.message
    return RequestError(e.code, message, name)


# -- the response -------------------------------------------------------------------------------------
def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [_text_part(text)] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def call_item(item_id: str, call: dict[str, Any], arguments: str, status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat reply (`message` of a chat completion) as Responses output items, in the order a stream sends them:
    the thought, the text, the calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(_new_id("rs"), message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(_new_id("msg"), message.get("content") or ""))
    items += [call_item(_new_id("fc"), c, c["function"]["arguments"]) for c in calls]
    return items


def history_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a later turn continues from (one assistant message)."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in items
        if i["type"] == "function_call"
    ]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


def usage(outs: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(o.metrics.num_prompt_tokens for o in outs)
    generated = sum(o.metrics.num_generated_tokens for o in outs)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": sum(o.metrics.num_cached_prompt_tokens for o in outs)},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }


@dataclass(slots=True)
class ResponseShell:
    """What every Response object of one request shares (its id, model, creation time, echoed fields)."""

    id: str
    model: str
    echoed: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        """The Response object; a reply cut by `max_output_tokens` is incomplete."""
        incomplete = None
        if status == "completed" and finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.echoed,
        }


class ResponseEvents:
    """A chat stream's chunks as the Responses stream's semantic events. One output item is open at a time
    (a reasoning item, a message with one output_text part, or a function call); the next kind of delta, or the
    end, closes it with its `.done` events. Each event carries `type` and its `sequence_number`."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # closed items, in output order
        self.open: dict[str, Any] | None = None  # {"kind", "id", "text", "call"}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    def start(self) -> list[str]:
        return [
            self.event("response.created", response=self.shell.body("in_progress", [])),
            self.event("response.in_progress", response=self.shell.body("in_progress", [])),
        ]

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk["choices"]:
            delta = choice.get("delta", {})
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _index(self) -> int:
        return len(self.items)

    def _open(self, kind: str) -> list[str]:
        """Close the open item and open a reasoning or message item (a message with its empty output_text part)."""
        out = self.close()
        self.open = {"kind": kind, "id": _new_id("rs" if kind == "reasoning" else "msg"), "text": ""}
        i, item_id = self._index(), self.open["id"]
        make = reasoning_item if kind == "reasoning" else message_item
        out.append(self.event("response.output_item.added", output_index=i, item=make(item_id, "", "in_progress")))
        if kind == "message":
            where = {"item_id": item_id, "output_index": i, "content_index": 0}
            out.append(self.event("response.content_part.added", **where, part=_text_part("")))
        return out

    def _text(self, kind: str, delta: str) -> list[str]:
        out = self._open(kind) if self.open is None or self.open["kind"] != kind else []
        assert self.open is not None
        self.open["text"] += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        out.append(
            self.event(name, item_id=self.open["id"], output_index=self._index(), content_index=0, delta=delta, **extra)
        )
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        """A tool-call delta: the head (id and name) opens a function_call item, the rest are its arguments."""
        out: list[str] = []
        if call.get("id") is not None:
            out += self.close()
            self.open = {"kind": "call", "id": _new_id("fc"), "text": "", "call": call}
            item = call_item(self.open["id"], call, "", "in_progress")
            out.append(self.event("response.output_item.added", output_index=self._index(), item=item))
        arguments = (call.get("function") or {}).get("arguments") or ""
        if arguments:
            assert self.open is not None and self.open["kind"] == "call", "a call's arguments follow its head"
            self.open["text"] += arguments
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=self.open["id"],
                    output_index=self._index(),
                    delta=arguments,
                )
            )
        return out

    def close(self) -> list[str]:
        """The open item's `.done` events (nothing when none is open)."""
        if self.open is None:
            return []
        kind, item_id, text, i = self.open["kind"], self.open["id"], self.open["text"], self._index()
        out = []
        if kind == "message":
            item = message_item(item_id, text)
            where = {"item_id": item_id, "output_index": i, "content_index": 0}
            out.append(self.event("response.output_text.done", **where, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, part=item["content"][0]))
        elif kind == "reasoning":
            item = reasoning_item(item_id, text)
            out.append(
                self.event("response.reasoning_text.done", item_id=item_id, output_index=i, content_index=0, text=text)
            )
        else:
            item = call_item(item_id, self.open["call"], text)
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item_id,
                    output_index=i,
                    name=item["name"],
                    arguments=text,
                )
            )
        out.append(self.event("response.output_item.done", output_index=i, item=item))
        self.items.append(item)
        self.open = None
        return out

    def finish(self) -> tuple[list[str], dict[str, Any]]:
        """The last events (an empty reply still gets its message item) and the completed Response object."""
        out = self.close()
        if not self.items:  # an empty reply still answers an (empty) message
            out += self._open("message") + self.close()
        response = self.shell.body("completed", self.items, self.usage, self.finish_reason)
        out.append(self.event("response.completed", response=response))
        return out, response


def _chat_usage(u: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat stream's usage chunk in Responses' words."""
    if u is None:
        return None
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


# -- the routes ---------------------------------------------------------------------------------------
class ResponsesRoute:
    """The three routes over one front and one store."""

    def __init__(self, front: OpenAIFront, capacity: int = MAX_STORED) -> None:
        self.front, self.store = front, ResponseStore(capacity)

    async def create(self, request: Request) -> Response:
        """POST /v1/responses."""
        front, streams = self.front, []
        try:
            front.check_auth(request)
            raw = await read_body(request, front.config.limits.max_body_bytes)
            parsed = await front._off_loop(to_chat, raw, self.store)
            try:
                chat = await front._off_loop(parse_body, parsed.chat, "chat", front.inputs.limits.max_chat_messages)
            except RequestError as e:
                raise _renamed(e) from None
            chat.max_tokens_name = "max_output_tokens"
            if chat.structured_param == "response_format":
                chat.structured_param = "text.format"
            chat.stream, chat.include_usage = parsed.stream, parsed.stream
            run = await front.start(request, chat)
            streams = run.streams
            shell = ResponseShell(_new_id("resp"), run.builder.model, parsed.echoed)
            if parsed.stream:
                return _EventStream(self._events(run, shell, parsed), lambda: front._abort(run.streams))
            outs = await front.finals(request, run)
            choice = run.builder.full(outs, run.n)["choices"][0]
            items = output_items(choice["message"])
            body = shell.body("completed", items, usage(outs), choice["finish_reason"])
            self._keep(parsed, body)
            front._count(METHOD, grpc.StatusCode.OK)
            return JSONResponse(body)
        except RequestError as e:
            front._abort(streams)
            front._count(METHOD, e.code)
            e = _renamed(e)
            return error_response(e.code, e.message, param=e.field)
        except Exception as e:  # noqa: BLE001 - this request fails alone, in OpenAI's shape, its pages freed
            front._abort(streams, "failed")
            error = convert.internal_error(f"{METHOD} failed: {type(e).__name__}: {e}", exc_info=True)
            front._count(METHOD, error.code)
            return error_response(error.code, error.message)

    def _keep(self, parsed: ResponsesRequest, body: dict[str, Any]) -> None:
        if parsed.store:
            self.store.put(Stored(body, parsed.history + history_of(body["output"])))

    async def _events(self, run: Run, shell: ResponseShell, parsed: ResponsesRequest) -> AsyncIterator[str]:
        events, status, done = ResponseEvents(shell), grpc.StatusCode.OK, False
        try:
            for e in events.start():
                yield e
            async for chunk in self.front.chunks(run):
                if chunk.get("usage") and not chunk["choices"]:
                    events.usage = _chat_usage(chunk["usage"])
                    continue
                for e in events.chunk({**chunk, "usage": None}):
                    yield e
            last, response = events.finish()
            self._keep(parsed, response)
            for e in last:
                yield e
            done = True
        except RequestError as e:  # after the response started: an error event ends it
            status, e = e.code, _renamed(e)
            yield events.event("error", **_error_fields(e.code, e.message, e.field))
        except Exception as e:  # noqa: BLE001 - this request fails alone; the cause goes to the log
            error = convert.internal_error(f"{METHOD} stream failed: {type(e).__name__}: {e}", exc_info=True)
            status = error.code
            yield events.event("error", **_error_fields(error.code, error.message, None))
        except BaseException:  # cancelled (the client went away) or closed early
            status = grpc.StatusCode.CANCELLED
            raise
        finally:
            if not done:
                self.front._abort(run.streams)
            self.front._count(METHOD, status)

    async def retrieve(self, request: Request, response_id: str) -> Response:
        """GET /v1/responses/{id}: a stored response (404 naming the id when there is none)."""
        self.front.check_auth(request)
        stored = self.store.get(response_id)
        if stored is None:
            e = _unknown(response_id, None)
            return error_response(e.code, e.message, param="response_id")
        return JSONResponse(stored.response)

    async def delete(self, request: Request, response_id: str) -> Response:
        """DELETE /v1/responses/{id}: forget a stored response (404 when there is none)."""
        self.front.check_auth(request)
        if not self.store.delete(response_id):
            e = _unknown(response_id, None)
            return error_response(e.code, e.message, param="response_id")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _error_fields(code: grpc.StatusCode, message: str, param: str | None) -> dict[str, Any]:
    error = error_body(code, message, param)[1]["error"]
    return {"code": error["code"], "message": error["message"], "param": error["param"]}
