"""Tool calls in the model's own format: which format a chat template uses, the grammar that forces a call, and
the parser that turns a reply back into calls (OpenAI's `tool_calls`).

A format belongs to a chat-template family, found in the template's text:
- `hermes` (Hermes 2 Pro, Qwen 2.5 / 3 and their derivatives): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, after optional content;
- `llama3` (Llama 3.1 / 3.2 JSON tool calling): the whole reply is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`.
A template in neither family has no format: a request that needs one (a forced `tool_choice`) is refused.
Forcing a call (`tool_choice` "required" or a named function) is a grammar whose JSON is the function's
`parameters` schema, so the reply always parses.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from paged_jax.bounded_json import MAX_DEPTH, load_json, nesting_depth
from paged_jax.errors import FieldError
from paged_jax.sampling_params import StructuredOutputs
from paged_jax.tokenization.chat_template import ChatTemplate

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # as the backend's


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True, slots=True)
class ParsedReply:
    content: str | None  # the text outside the calls (None when there is none)
    tool_calls: list[ToolCall]


def function_specs(tools: Any, field_name: str = "tools") -> dict[str, dict[str, Any]]:
    """name -> parameters schema of OpenAI-style `tools` (`[{"type": "function", "function": {"name",
    "parameters"}}]`). Raises ValueError naming the entry at fault."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ValueError(f"{field_name}: must be a list of tools")
    out = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise ValueError(f"{field_name}[{i}]: must be {{'type': 'function', 'function': {{'name', 'parameters'}}}}")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object"})
        if not isinstance(name, str) or not name:
            raise ValueError(f"{field_name}[{i}].function.name: must be a non-empty string")
        if not isinstance(params, Mapping):
            raise ValueError(f"{field_name}[{i}].function.parameters: must be a JSON Schema object")
        out[name] = dict(params)
    return out


class ToolFormat:
    """One family's tool-call syntax: `grammar` forces calls, `parse` reads them, `may_start` finds where one
    may begin in streamed text (what comes before it is plain content)."""

    name: str

    def grammar(self, functions: Mapping[str, Mapping[str, Any]]) -> StructuredOutputs:
        """The constraint that the reply is one call of one of `functions` (name -> parameters schema)."""
        raise NotImplementedError

    def parse(self, text: str) -> ParsedReply:
        raise NotImplementedError

    def may_start(self, text: str) -> int | None:
        """The index in `text` from which a call may be under way (text held back while streaming), or None."""
        raise NotImplementedError


def _call_schema(name: str, params: Mapping[str, Any], args_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, args_key: dict(params)},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _one_of(functions: Mapping[str, Mapping[str, Any]], args_key: str) -> dict[str, Any]:
    calls = [_call_schema(n, p, args_key) for n, p in functions.items()]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "x-guidance": JSON_STYLE}


def _call(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = load_json(args, "arguments")
        except ValueError:  # not JSON, or past the bounds: not a call
            return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


def _content(pieces: Sequence[str]) -> str | None:
    """The reply's text outside its calls: each piece stripped, the non-empty ones one per line."""
    return "\n".join(p.strip() for p in pieces if p.strip()) or None


class HermesFormat(ToolFormat):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def grammar(self, functions: Mapping[str, Mapping[str, Any]]) -> StructuredOutputs:
        schema = json.dumps(_one_of(functions, "arguments"))
        return StructuredOutputs(grammar=f'start: "{self.START}\\n" %json {schema} "\\n{self.END}"\n')

    def parse(self, text: str) -> ParsedReply:
        """Every `<tool_call>` block, each parsed with the bounds of `paged_jax.bounded_json` (a reply nested
        thousands deep is text, never a RecursionError); the text before, between and after the calls is the
        content. A malformed call leaves the whole reply as text."""
        calls, outside, pos = [], [], 0
        for m in self._CALL.finditer(text):
            try:
                call = _call(load_json(m.group(1), "tool call"), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                return ParsedReply(text, [])  # a malformed call: the reply stays text
            calls.append(call)
            outside.append(text[pos : m.start()])
            pos = m.end()
        if not calls:
            return ParsedReply(text, [])
        return ParsedReply(_content([*outside, text[pos:]]), calls)

    def may_start(self, text: str) -> int | None:
        i = text.find(self.START)
        if i >= 0:
            return i
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):  # a marker's first characters at the end
            if self.START.startswith(text[-k:]):
                return len(text) - k
        return None


class Llama3Format(ToolFormat):
    name = "llama3"
    TAG = "<|python_tag|>"

    def grammar(self, functions: Mapping[str, Mapping[str, Any]]) -> StructuredOutputs:
        return StructuredOutputs(json=_one_of(functions, "parameters"))

    def parse(self, text: str) -> ParsedReply:
        """One JSON call, or several separated by `;` (Llama 3.2), read one after another with
        `raw_decode` once the reply's nesting is known to be within `MAX_DEPTH` (no unbounded recursion);
        text after the last call is the content."""
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{") or nesting_depth(body) > MAX_DEPTH:
            return ParsedReply(text, [])
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body) and body[pos] == "{":
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:  # not JSON, or an integer of more digits than int() reads
                break
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        if not calls:
            return ParsedReply(text, [])
        return ParsedReply(_content([body[pos:]]), calls)

    def may_start(self, text: str) -> int | None:
        head = text.lstrip()
        if not head or head.startswith(("{", self.TAG)) or self.TAG.startswith(head):
            return 0
        return None


FORMATS: dict[str, ToolFormat] = {"hermes": HermesFormat(), "llama3": Llama3Format()}


def tool_format(template: ChatTemplate | None) -> ToolFormat | None:
    """The tool-call format of a chat template's family (see the module docstring), None when unknown."""
    if template is None:
        return None
    text = "\n".join(template.templates.values())
    if HermesFormat.START in text:
        return FORMATS["hermes"]
    if Llama3Format.TAG in text or ("<|start_header_id|>" in text and "parameters" in text and "tools" in text):
        return FORMATS["llama3"]
    return None


def history_tool_calls(calls: Any, field_name: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI `tool_calls` as chat templates read them: `function.arguments` an object
    (OpenAI sends its JSON text, parsed here with the bounds of `paged_jax.bounded_json`). Raises FieldError
    naming the entry at fault (`messages[1].tool_calls[0].function.arguments`)."""
    if not isinstance(calls, list):
        raise FieldError(field_name, "must be a list of tool calls")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise FieldError(f"{field_name}[{i}].function", "must be an object with a name and arguments")
        where = f"{field_name}[{i}].function.arguments"
        args = fn.get("arguments", {})
        if isinstance(args, str):
            args = load_json(args, where) if args.strip() else {}
        if not isinstance(args, Mapping):
            raise FieldError(where, "must be a JSON object")
        out.append({**call, "type": "function", "function": {**fn, "arguments": dict(args)}})
    return out
