"""Tool calls in the model's own format: which format a chat template uses, the grammar that forces a call, and
the parser that turns a reply back into calls (OpenAI's `tool_calls`).

A format belongs to a chat-template family, found in the template's text (or named by `--tool-call-parser`):
- `hermes` (Hermes 2 Pro, Qwen 2.5 / 3 and their derivatives): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, after optional content;
- `qwen3_coder` (Qwen3-Coder, Qwen3.5): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>
  ...</function>\\n</tool_call>`, a value being text (a string parameter) or JSON;
- `llama3` (Llama 3.1 / 3.2 JSON tool calling): the whole reply is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`, several separated by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (or, with newer tokenizers,
  `NAME[ARGS]{...}` per call);
- `deepseek_v3` (DeepSeek-V3 / R1): `<｜tool▁calls▁begin｜>` then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`, then
  `<｜tool▁calls▁end｜>`.
A template in none of them whose text never reads `tools` gets the tool definitions in a system message of
the generic form (`generic_tool_prompt`) and its replies are read as `hermes`; so every model can be asked
for (and forced to make) a call. Forcing a call (`tool_choice` "required" or a named function) is a grammar
whose JSON is the function's `parameters` schema, so the reply always parses.

A call's `arguments` is the JSON text the model wrote (in the JSON families), or the parameters as a JSON object
(`qwen3_coder`); `progress` reads a reply that is still being written, so a stream can send each call's name
and then its arguments in pieces that join to exactly what `parse` reads from the whole reply.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from paged_jax.bounded_json import MAX_DEPTH, load_json, nesting_depth
from paged_jax.config.engine import TOOL_CALL_PARSERS
from paged_jax.errors import FieldError
from paged_jax.sampling_params import StructuredOutputs
from paged_jax.tokenization.chat_template import ChatTemplate
from paged_jax.tokenization.json_scan import ObjectScan, scan_object, scan_objects, skip_ws

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # as the backend's


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True, slots=True)
class CallProgress:
    """A call as far as a reply being written holds it: its name, and its arguments text (the start of it while
    `done` is False; the start only grows as the reply goes on)."""

    name: str
    arguments: str
    done: bool


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

    def progress(self, text: str) -> list[CallProgress]:
        """The calls of a reply that may stop anywhere: those `parse` reads, then the one under way once its
        name is known and its arguments have begun (their text so far)."""
        done = [CallProgress(c.name, c.arguments, True) for c in self.parse(text).tool_calls]
        under_way = self._under_way(text)
        return done if under_way is None else [*done, under_way]

    def _under_way(self, text: str) -> CallProgress | None:
        """The call after the last complete one in `text`, begun but not complete (None: none)."""
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


def _call(obj: Any, args_keys: tuple[str, ...], raw: str) -> ToolCall | None:
    """The call of a parsed call object `obj` whose text is `raw`: its arguments member (the first of
    `args_keys` present) as written, or, given as a JSON string, that string's object; None: not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in args_keys if k in obj), None)
    args: Any = {} if key is None else obj[key]
    if isinstance(args, str):
        try:
            args = load_json(args, "arguments")
        except ValueError:  # not JSON, or past the bounds: not a call
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None
    if not isinstance(args, dict):
        return None
    if key is None:
        return ToolCall(obj["name"], "{}")
    member = scan_object(raw, 0).members[key]
    return ToolCall(obj["name"], raw[member.start : member.end])


_ARGS = ("arguments", "parameters")  # the keys a call object's arguments may go by, the first one first


def _raw_call(name: str, raw: str) -> ToolCall | None:
    """The call of `name` whose arguments are the JSON text `raw` (an object, else not a call)."""
    try:
        args = load_json(raw, "arguments")
    except ValueError:
        return None
    return ToolCall(name, raw.strip(" \t\r\n")) if isinstance(args, dict) and name else None


def _object_call(raw: str) -> ToolCall | None:
    """The call of the call object `raw` (None: not JSON, or not a call)."""
    try:
        return _call(load_json(raw, "tool call"), _ARGS, raw)
    except ValueError:
        return None


def _object_under_way(text: str, pos: int, args_keys: tuple[str, ...]) -> CallProgress | None:
    """The call object under way at `text[pos:]`: once its name is complete and its arguments member has begun
    (an object: its text so far; a JSON string, read only once complete: no text yet)."""
    scan = scan_object(text, pos)
    return _named_under_way(text, scan, args_keys)


def _named_under_way(text: str, scan: ObjectScan, args_keys: tuple[str, ...]) -> CallProgress | None:
    name, key = scan.members.get("name"), next((k for k in args_keys if k in scan.members), None)
    if not scan.ok or scan.end is not None or name is None or name.end is None or key is None:
        return None
    value = json.loads(text[name.start : name.end]) if text[name.start] == '"' else None
    args = scan.members[key]
    if not isinstance(value, str) or text[args.start] not in '{"':
        return None
    return CallProgress(value, text[args.start : args.end or len(text)] if text[args.start] == "{" else "", False)


def _args_under_way(name: str, text: str, pos: int) -> CallProgress | None:
    """The call of `name` whose arguments object is under way at `text[pos:]`."""
    i = skip_ws(text, pos)
    if i == len(text) or text[i] != "{":
        return None
    scan = scan_object(text, i)
    if not scan.ok:
        return None
    return CallProgress(name, text[i : scan.end or len(text)], False)


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
        content. A malformed block stays in the content (so the calls of a reply's start never change as it
        goes on: the stream sends each as soon as it parses)."""
        calls, outside, pos = [], [], 0
        for m in self._CALL.finditer(text):
            call = _object_call(m.group(1))
            if call is None:
                continue  # a malformed block: text
            calls.append(call)
            outside.append(text[pos : m.start()])
            pos = m.end()
        if not calls:
            return ParsedReply(text, [])
        return ParsedReply(_content([*outside, text[pos:]]), calls)

    def may_start(self, text: str) -> int | None:
        return _held_start(text, self.START)

    def _under_way(self, text: str) -> CallProgress | None:
        j = text.find(self.START, text.rfind(self.END) + 1)
        return None if j < 0 else _object_under_way(text, j + len(self.START), _ARGS)


class Llama3Format(ToolFormat):
    name = "llama3"
    TAG = "<|python_tag|>"

    def grammar(self, functions: Mapping[str, Mapping[str, Any]]) -> StructuredOutputs:
        return StructuredOutputs(json=_one_of(functions, "parameters"))

    def parse(self, text: str) -> ParsedReply:
        """One JSON call, or several separated by `;` (Llama 3.2), read one after another with
        `raw_decode` once the reply's nesting is known to be within `MAX_DEPTH` (no unbounded recursion);
        text after the last call is the content."""
        body, calls, pos = self._read(text)
        if not calls:
            return ParsedReply(text, [])
        return ParsedReply(_content([body[pos:]]), calls)

    def _read(self, text: str) -> tuple[str, list[ToolCall], int]:
        """(the reply without its tag, its calls, where the text after them begins)."""
        body = text.lstrip().removeprefix(self.TAG).lstrip()
        if not body.startswith("{") or nesting_depth(body) > MAX_DEPTH:
            return body, [], 0
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body) and body[pos] == "{":
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:  # not JSON, or an integer of more digits than int() reads
                break
            call = _call(obj, ("parameters", "arguments"), body[pos:end])
            if call is None:
                break
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return body, calls, pos

    def _under_way(self, text: str) -> CallProgress | None:
        body, _, pos = self._read(text)
        return _object_under_way(body, pos, ("parameters", "arguments")) if body.startswith("{") else None

    def may_start(self, text: str) -> int | None:
        head = text.lstrip()
        if not head or head.startswith(("{", self.TAG)) or self.TAG.startswith(head):
            return 0
        return None


def _held_start(text: str, marker: str) -> int | None:
    """Where `marker` (or its first characters at the end of `text`) begins in `text`; None: nowhere."""
    i = text.find(marker)
    if i >= 0:
        return i
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return None


def _lark_string(text: str) -> str:
    return json.dumps(text)


class Qwen3CoderFormat(ToolFormat):
    name = "qwen3_coder"
    START, CALL_END = "<tool_call>", "</function>\n</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
    _HEAD = re.compile(r"\s*<function=([^>\n]+)>")

    def grammar(self, functions: Mapping[str, Mapping[str, Any]]) -> StructuredOutputs:
        """Each function's required parameters in order: a string one as a line of text without `<`, an enum of
        strings as its choices, any other as JSON of its schema."""
        rules, calls = [], []
        for i, (name, params) in enumerate(functions.items()):
            props, parts = params.get("properties") or {}, []
            for key in params.get("required") or []:
                spec = props.get(key, {})
                if isinstance(spec.get("enum"), list) and all(isinstance(v, str) for v in spec["enum"]):
                    value = "(" + " | ".join(_lark_string(v) for v in spec["enum"]) + ")"
                elif spec.get("type") == "string":
                    value = "/[^<\\n]*/"  # one line: the lexeme must end before the closing tag
                else:
                    value = f"%json {json.dumps({**spec, 'x-guidance': JSON_STYLE})}"
                opening, closing = _lark_string(f"<parameter={key}>\n"), _lark_string("\n</parameter>\n")
                parts.append(f"{opening} {value} {closing}")
            head = _lark_string(f"<tool_call>\n<function={name}>\n")
            rules.append(f"call{i}: {head} {' '.join(parts)} {_lark_string(self.CALL_END)}")
            calls.append(f"call{i}")
        return StructuredOutputs(grammar="start: " + " | ".join(calls) + "\n" + "\n".join(rules) + "\n")

    def parse(self, text: str) -> ParsedReply:
        """Every `<tool_call><function=...>` block; a parameter's value is JSON when it reads as a JSON number,
        boolean, null, array or object (bounded), else the text itself (a string parameter)."""
        calls, outside, pos = [], [], 0
        for m in self._CALL.finditer(text):
            calls.append(ToolCall(m.group(1).strip(), "{" + ", ".join(self._members(m.group(2))) + "}"))
            outside.append(text[pos : m.start()])
            pos = m.end()
        if not calls:
            return ParsedReply(text, [])
        return ParsedReply(_content([*outside, text[pos:]]), calls)

    def may_start(self, text: str) -> int | None:
        return _held_start(text, self.START)

    def _members(self, body: str) -> list[str]:
        """The JSON members (`"key": value`) of the complete parameters in a call's body, in order."""
        return [
            f"{json.dumps(p.group(1).strip(), ensure_ascii=False)}: "
            f"{json.dumps(_xml_value(p.group(2)), ensure_ascii=False)}"
            for p in self._PARAM.finditer(body)
        ]

    def _under_way(self, text: str) -> CallProgress | None:
        j = text.find(self.START, text.rfind("</tool_call>") + 1)
        head = self._HEAD.match(text, j + len(self.START)) if j >= 0 else None
        if head is None:
            return None
        return CallProgress(head.group(1).strip(), "{" + ", ".join(self._members(text[head.end() :])), False)


def _xml_value(raw: str) -> Any:
    value = raw.strip()
    if value[:1] in ("{", "[", "-") or value[:1].isdigit() or value in ("true", "false", "null"):
        try:
            return load_json(value, "parameter")
        except ValueError:
            pass
    return raw


class MistralFormat(ToolFormat):
    name = "mistral"
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def grammar(self, functions: Mapping[str, Mapping[str, Any]]) -> StructuredOutputs:
        schema = {"type": "array", "items": _one_of(functions, "arguments"), "minItems": 1, "maxItems": 1}
        return StructuredOutputs(grammar=f"start: {_lark_string(self.TAG)} %json {json.dumps(schema)}\n")

    def parse(self, text: str) -> ParsedReply:
        """`[TOOL_CALLS]` and a JSON array of calls, or `NAME[ARGS]{...}` after each `[TOOL_CALLS]`; the text
        before the first is the content. Anything malformed leaves the reply as text."""
        i = text.find(self.TAG)
        if i < 0:
            return ParsedReply(text, [])
        calls: list[ToolCall] = []
        for piece in text[i + len(self.TAG) :].split(self.TAG):
            found = self._piece_calls(piece.strip())
            if not found:
                return ParsedReply(text, [])
            calls.extend(found)
        return ParsedReply(_content([text[:i]]), calls)

    def _piece_calls(self, piece: str) -> list[ToolCall] | None:
        """The calls of the text after one `[TOOL_CALLS]` (None: it holds anything else)."""
        if self.ARGS in piece or piece.startswith("{"):
            name, _, raw = piece.partition(self.ARGS)
            call = _raw_call(name.strip(), raw) if raw else _object_call(piece)
            return None if call is None else [call]
        arr = scan_objects(piece, 0)
        if not arr.ok or arr.end is None or piece[arr.end :].strip():
            return None
        try:
            load_json(piece, "tool calls")
        except ValueError:
            return None
        calls = [_object_call(piece[s : o.end]) for s, o in arr.items]
        found = [c for c in calls if c is not None]
        return found if found and len(found) == len(calls) else None

    def progress(self, text: str) -> list[CallProgress]:
        """Each `[TOOL_CALLS]` piece but the last read whole; in the last (still being written), the array's
        complete items and the one under way, or the `NAME[ARGS]` call under way."""
        i = text.find(self.TAG)
        if i < 0:
            return []
        *pieces, last = text[i + len(self.TAG) :].split(self.TAG)
        out: list[CallProgress] = []
        for piece in pieces:
            found = self._piece_calls(piece.strip())
            if not found:
                return out
            out.extend(CallProgress(c.name, c.arguments, True) for c in found)
        if self.ARGS in last:
            name, _, raw = last.partition(self.ARGS)
            under_way = _args_under_way(name.strip(), raw, 0) if name.strip() else None
            return out if under_way is None else [*out, under_way]
        if last.lstrip().startswith("{"):
            under_way = _object_under_way(last, 0, _ARGS)
            return out if under_way is None else [*out, under_way]
        arr = scan_objects(last, 0)
        for start, item in arr.items:
            if item.end is None:
                under_way = _named_under_way(last, item, _ARGS)
                return out if under_way is None else [*out, under_way]
            call = _object_call(last[start : item.end])
            if call is None:
                return out
            out.append(CallProgress(call.name, call.arguments, True))
        return out

    def may_start(self, text: str) -> int | None:
        return _held_start(text, self.TAG)


class DeepSeekV3Format(ToolFormat):
    name = "deepseek_v3"
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    ARGS_END = "\n```" + CALL_END
    _HEAD = re.compile(r"<｜tool▁call▁begin｜>\w*<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n")
    _CALL = re.compile(
        r"<｜tool▁call▁begin｜>\w*<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*?)\n```<｜tool▁call▁end｜>", re.S
    )

    def grammar(self, functions: Mapping[str, Mapping[str, Any]]) -> StructuredOutputs:
        rules, calls = [], []
        for i, (name, params) in enumerate(functions.items()):
            head = _lark_string(f"{self.CALL}function{self.SEP}{name}\n```json\n")
            schema = json.dumps({**dict(params), "x-guidance": JSON_STYLE})
            rules.append(f"call{i}: {head} %json {schema} {_lark_string(self.ARGS_END)}")
            calls.append(f"call{i}")
        start = f"start: {_lark_string(self.BEGIN)} ({' | '.join(calls)}) {_lark_string(self.END)}\n"
        return StructuredOutputs(grammar=start + "\n".join(rules) + "\n")

    def parse(self, text: str) -> ParsedReply:
        i = text.find(self.BEGIN)
        if i < 0:
            return ParsedReply(text, [])
        body, _, after = text[i + len(self.BEGIN) :].partition(self.END)
        calls = []
        for m in self._CALL.finditer(body):
            call = _raw_call(m.group(1).strip(), m.group(2))
            if call is None:
                return ParsedReply(text, [])
            calls.append(call)
        if not calls:
            return ParsedReply(text, [])
        return ParsedReply(_content([text[:i], after]), calls)

    def may_start(self, text: str) -> int | None:
        return _held_start(text, self.BEGIN)

    def _under_way(self, text: str) -> CallProgress | None:
        i = text.find(self.BEGIN)
        if i < 0:
            return None
        j = text.find(self.CALL, max(i, text.rfind(self.CALL_END)))
        head = self._HEAD.match(text, j) if j >= 0 else None
        return None if head is None else _args_under_way(head.group(1).strip(), text, head.end())


FORMATS: dict[str, ToolFormat] = {
    f.name: f for f in (HermesFormat(), Qwen3CoderFormat(), Llama3Format(), MistralFormat(), DeepSeekV3Format())
}


def tool_format(template: ChatTemplate | None, parser: str = "auto") -> ToolFormat | None:
    """The tool-call format of a chat template's family (see the module docstring), or the one `parser` names
    ("none": none); None when the template is in no family."""
    if parser != "auto":
        if parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser: {parser!r} is not one of {', '.join(TOOL_CALL_PARSERS)}")
        return FORMATS.get(parser)
    if template is None:
        return None
    text = "\n".join(template.templates.values())
    if DeepSeekV3Format.BEGIN in text:
        return FORMATS["deepseek_v3"]
    if MistralFormat.TAG in text:
        return FORMATS["mistral"]
    if HermesFormat.START in text and "<function=" in text:
        return FORMATS["qwen3_coder"]
    if HermesFormat.START in text:
        return FORMATS["hermes"]
    if Llama3Format.TAG in text or ("<|start_header_id|>" in text and "parameters" in text and "tools" in text):
        return FORMATS["llama3"]
    return None


def reads_tools(template: ChatTemplate | None) -> bool:
    """Whether a chat template renders `tools` at all (else `generic_tool_prompt` tells the model of them)."""
    return template is not None and any("tools" in t for t in template.templates.values())


def generic_tool_prompt(tools: Sequence[Any]) -> str:
    """The system text that describes `tools` to a model whose template has no tools section: each tool's JSON
    inside `<tools></tools>`, and the `hermes` call syntax its replies are then read with."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions, as JSON schemas:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a function, reply with a JSON object of its name and arguments inside <tool_call></tool_call> "
        'tags, one block per call:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call>"
    )


def with_tool_prompt(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any]) -> list[dict[str, Any]]:
    """`messages` with `generic_tool_prompt(tools)` added to their system message (one put first if none)."""
    out = [dict(m) for m in messages]
    text = generic_tool_prompt(tools)
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0]["content"] = f"{out[0]['content']}\n\n{text}"
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


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
