"""Where the members of a JSON object lie in a text that may stop inside it: what a streamed tool call needs to
send its name, and its arguments as the model writes them, before the call is complete.

`scan_object(text, pos)` reads the object that begins at `text[pos]` (after JSON whitespace) token by token (a
regular expression per token, no recursion) and returns each top-level member's key with the span of its raw
value, a value's end being None while the text stops inside it. Nothing here decodes a whole value: a caller
that needs one (the call, once complete) parses it with `paged_jax.bounded_json.load_json`, so a span is only
ever a place in the text, and a text that is not (the start of) a JSON object is `ok=False`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_WS = re.compile(r"[ \t\r\n]*")
_ATOM = re.compile(r'[^ \t\r\n{}\[\]:,"]+')  # a number or a literal (its validity is load_json's to judge)


@dataclass(slots=True)
class Member:
    """One top-level member: its raw value is `text[start:end]`; `end` None while the text stops inside it."""

    start: int
    end: int | None = None


@dataclass(slots=True)
class ObjectScan:
    """An object read from `text[pos]`: its members by key (the last of a repeated key, as `json.loads` keeps),
    `end` (the index after its closing brace; None while it is open), and `ok` (False: not a JSON object's
    start)."""

    members: dict[str, Member] = field(default_factory=dict)
    end: int | None = None
    ok: bool = True


def _string_end(text: str, i: int) -> int | None:
    """The index after the string that opens at `text[i]` (a quote), or None while it is open: the next quote
    that an even number of backslashes precedes (found with `str.find`, so a long string costs C speed)."""
    j = i + 1
    while (k := text.find('"', j)) >= 0:
        b = k
        while text[b - 1] == "\\":
            b -= 1
        if (k - b) % 2 == 0:
            return k + 1
        j = k + 1
    return None


def skip_ws(text: str, pos: int) -> int:
    """The index of the first character at or after `pos` that is not JSON whitespace."""
    m = _WS.match(text, pos)
    assert m is not None  # the pattern matches the empty string
    return m.end()


def scan_object(text: str, pos: int) -> ObjectScan:
    """The top-level members of the object at `text[pos:]` (see `ObjectScan`)."""
    out = ObjectScan()
    i = skip_ws(text, pos)
    if i == len(text):
        return out
    if text[i] != "{":
        out.ok = False
        return out
    stack, i, expect = "{", i + 1, "key"  # expect at depth 1: key, colon, value, comma (or the closing brace)
    key: str | None = None
    while True:
        i = skip_ws(text, i)
        if i == len(text):
            return out
        ch = text[i]
        if len(stack) == 1 and expect != "value":
            if ch == "}" and expect in ("key", "comma"):
                out.end = i + 1
                return out
            if expect == "key" and ch == '"':
                end = _string_end(text, i)
                if end is None:
                    return out  # a key under way
                key, i, expect = json.loads(text[i:end]), end, "colon"
            elif (expect, ch) in (("colon", ":"), ("comma", ",")):
                i, expect = i + 1, "value" if ch == ":" else "key"
            else:
                out.ok = False
                return out
            continue
        if len(stack) == 1:  # a member's value begins here
            assert key is not None
            out.members[key] = Member(i)
        if ch in "{[":
            stack += ch
            i += 1
        elif ch in "}]":
            if len(stack) == 1 or "{[".index(stack[-1]) != "}]".index(ch):
                out.ok = False
                return out
            stack = stack[:-1]
            i += 1
        elif ch == '"':
            end = _string_end(text, i)
            if end is None:
                return out  # a string under way
            i = end
        elif ch in ":,":
            if len(stack) == 1:
                out.ok = False
                return out
            i += 1
        else:
            m = _ATOM.match(text, i)
            assert m is not None  # ch is none of the characters _ATOM excludes
            if m.end() == len(text):
                return out  # a number may go on
            i = m.end()
        if len(stack) == 1:
            assert key is not None
            out.members[key].end = i
            expect = "comma"


@dataclass(slots=True)
class ArrayScan:
    """An array of objects read from `text[pos]`: each item's start and scan (the last one possibly open), `end`
    (the index after the closing bracket; None while it is open), and `ok` (False: not an array of objects)."""

    items: list[tuple[int, ObjectScan]] = field(default_factory=list)
    end: int | None = None
    ok: bool = True


def scan_objects(text: str, pos: int) -> ArrayScan:
    """The objects of the array at `text[pos:]` (see `ArrayScan`)."""
    out = ArrayScan()
    i = skip_ws(text, pos)
    if i == len(text):
        return out
    if text[i] != "[":
        out.ok = False
        return out
    i = skip_ws(text, i + 1)
    while i < len(text):
        if text[i] == "]" and not out.items:
            out.end = i + 1
            return out
        item = scan_object(text, i)
        out.items.append((i, item))
        if not item.ok or item.end is None:
            out.ok = item.ok
            return out
        i = skip_ws(text, item.end)
        if i == len(text):
            return out
        if text[i] == "]":
            out.end = i + 1
            return out
        if text[i] != ",":
            out.ok = False
            return out
        i = skip_ws(text, i + 1)
    return out
