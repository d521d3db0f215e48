"""JSON from clients, parsed with bounds: what both fronts read before any field is looked at.

Python's `json` accepts things no request needs and that later fail deep inside the server: input nested
100,000 deep (a `RecursionError` in the parser; a few hundred levels are enough to exhaust the recursion of
a template or a grammar compiler later), integers of thousands of digits (`int()` refuses more than 4,300,
`float()` overflows on `10**400`), `NaN` and `Infinity` (not JSON), and `\\ud800` escapes, which decode to
lone surrogates that no UTF-8 encoder or tokenizer accepts. `load_json` refuses all of these in one pass,
with a `FieldError` naming where the value sits (`messages[0].name`, `chat.tools_json[0].function`), so
every front answers INVALID_ARGUMENT (HTTP 400) instead of an internal error.

The HTTP body, the lora load/unload bodies and gRPC's JSON string fields (`chat.tools_json`,
`chat.chat_template_kwargs_json`, `tool_calls_json`, `structured_output.json_schema`) all come through here, and
so does every JSON text inside a string field (`structured_outputs.json`, `structural_tag`, a history call's
`function.arguments`, a tool call in the model's reply). `bounded_dumps` is the other direction: a value built
in Python (the `LLM` API's schema dicts) serialized only after a walk, bounded by the size it may reach, has
found it within the same depth, integer and size limits.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from paged_jax.errors import FieldError

MAX_DEPTH = 64  # arrays and objects inside one another (OpenAI bodies with JSON schemas need under 20)
MAX_INT = 2**64  # JSON integers a request may hold, in magnitude (every integer field fits in 64 bits)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a JSON text spells a surrogate (paired or lone)
_NESTING = np.zeros(256, np.int8)
_NESTING[[ord("["), ord("{")]], _NESTING[[ord("]"), ord("}")]] = 1, -1


class _Refused:
    """A value the parser hooks set aside (too large an integer, NaN/Infinity), refused once its place is known."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def load_json(data: bytes | str, field: str = "body") -> Any:
    """The JSON value of `data`; raises FieldError naming the place at fault. Places are paths below `field`
    (`field` itself for the whole document); for `field="body"` the paths are the body's own parameter names
    (`max_tokens`, `messages[0].content`), as OpenAI's `param` names them.

    The common case costs about one `json.loads`: the nesting depth is read off the bytes (strings cut out,
    brackets counted by numpy), integers and constants are checked by the parser's hooks, and surrogates by
    re-encoding only when the text spells one; the value is walked (to name the place) only when one of
    these found something."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    refused: list[_Refused] = []

    def parse_int(text: str) -> int | _Refused:
        if len(text) > 21 or abs(value := int(text)) >= MAX_INT:  # 21: a sign and 20 digits
            refused.append(_Refused(f"an integer of {len(text.lstrip('-'))} digits, beyond the limit of 2^64"))
            return refused[-1]
        return value

    def parse_constant(name: str) -> _Refused:
        refused.append(_Refused(f"{name} is not a JSON number"))
        return refused[-1]

    too_deep = nesting_depth(raw) > MAX_DEPTH
    try:
        value = json.loads(raw, parse_int=parse_int, parse_constant=parse_constant)
    except RecursionError:
        raise FieldError(field, f"nested deeper than the limit of {MAX_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FieldError(field, f"not valid JSON ({e})") from None
    surrogates = _SURROGATE_ESCAPE.search(raw) is not None and not _encodes(value)
    if too_deep or refused or surrogates:
        _check(value, field, surrogates)
    return value


def bounded_dumps(value: Any, field: str, max_bytes: int) -> str:
    """`json.dumps(value)`, or a FieldError naming `field` when `value` nests deeper than MAX_DEPTH, holds an
    integer beyond MAX_INT or a non-finite float, or is more than `max_bytes` long as JSON. The check walks
    `value` iteratively and stops once the text it adds up passes `max_bytes`, so a huge value costs no more
    than `max_bytes` of work before it is refused (and `json.dumps` never sees it)."""
    size = 0  # never more than the length of `json.dumps(value)`: a value within the limit is never refused
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth >= MAX_DEPTH:
                raise FieldError(field, f"nested deeper than the limit of {MAX_DEPTH} levels")
            size += 2 + 2 * max(len(item) - 1, 0)  # brackets and separators
            if isinstance(item, dict):
                size += sum(len(str(k)) + 4 for k in item)  # quotes, ": "
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, str):
            size += len(item) + 2
        elif isinstance(item, bool) or item is None:
            size += 4
        elif isinstance(item, int):
            if abs(item) >= MAX_INT:
                raise FieldError(field, "an integer beyond the limit of 2^64")
            size += len(str(item))
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise FieldError(field, f"{item} is not a JSON number")
            size += len(repr(item))
        else:
            raise FieldError(field, f"a {type(item).__name__} is not a JSON value")
        if size > max_bytes:
            raise FieldError(field, f"more than {max_bytes} bytes as JSON, the server's limit")
    text = json.dumps(value)
    if len(text) > max_bytes:
        raise FieldError(field, f"{len(text)} bytes as JSON, more than the server's limit of {max_bytes}")
    return text


def nesting_depth(data: bytes | str) -> int:
    """How deep arrays and objects nest in a JSON text (or in JSON followed by other text): escape pairs
    dropped, so every quote left opens or closes a string; then only quotes and brackets kept, and the
    brackets outside strings counted (numpy throughout: no Python work per byte)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    text = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    lower = text | 32  # [ and { both become {, ] and } both }
    marks = text[(text == ord('"')) | (lower == ord("{")) | (lower == ord("}"))]
    outside = (np.cumsum(marks == ord('"'), dtype=np.int32) & 1) == 0  # a closing quote counts as inside
    return int(np.cumsum(_NESTING[marks] * outside, dtype=np.int32).max(initial=0))


def _encodes(value: Any) -> bool:
    """Whether every string of `value` is valid Unicode (one C-speed pass: json.dumps, then UTF-8)."""
    try:
        json.dumps(value, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check(root: Any, field: str, strings: bool) -> None:
    """Find and name the first place nested past MAX_DEPTH, set aside by the parser or (when `strings`) holding
    a lone surrogate, in one iterative walk (a recursive one would fail on the inputs it exists to refuse)."""
    stack: list[tuple[Any, int, tuple]] = [(root, 0, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, dict | list):
            if depth >= MAX_DEPTH:
                raise FieldError(_place(field, path), f"nested deeper than the limit of {MAX_DEPTH} levels")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if strings and isinstance(key, str) and _surrogate_at(key) >= 0:
                    raise FieldError(_place(field, path), "a key is not valid Unicode (a lone surrogate)")
                if isinstance(item, dict | list | _Refused) or (strings and isinstance(item, str)):
                    stack.append((item, depth + 1, (path, key)))
        elif isinstance(value, _Refused):
            raise FieldError(_place(field, path), value.why)
        elif isinstance(value, str) and (start := _surrogate_at(value)) >= 0:
            raise FieldError(_place(field, path), f"not valid Unicode (a lone surrogate at character {start})")


def _surrogate_at(text: str) -> int:
    """Where the first lone surrogate of `text` is (-1: none, the text is valid Unicode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return -1


def _place(field: str, path: tuple) -> str:
    """`field` followed by the keys and indices of `path` (a linked list of (parent, key) pairs)."""
    keys: list[Any] = []
    while path:
        path, key = path
        keys.append(key)
    out = "" if field == "body" and keys else field
    for key in reversed(keys):
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


__all__ = ["MAX_DEPTH", "MAX_INT", "bounded_dumps", "load_json", "nesting_depth"]
