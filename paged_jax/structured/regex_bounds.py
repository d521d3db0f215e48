"""How large a regex becomes once its counted repetitions are written out, measured before anything compiles it.

llguidance compiles a regex lazily: `(a{700}){700}` compiles in milliseconds, and the cost comes later, in the
first masks, where the lexer builds the states of a 490,000-atom expression while the engine waits. What a
counted repetition costs is its count times the size of what it repeats, and nesting multiplies: so the
measure is the regex's *expansion*, the number of atoms it has with every `x{m,n}` replaced by `n` copies of
`x` (`m` when unbounded) and alternatives added up. `(a{700}){700}` expands to 490,000 atoms, `a{9999}` to
9,999, `[a-z]+` to 1 (an unbounded `*` or `+` is a loop, not copies). A constraint whose regexes expand past
the bound (`StructuredLimits.max_regex_expansion`) is refused before it compiles, naming its field.

The scanner reads the dialects a constraint may use (Python's `re`, Rust's `regex` that llguidance speaks, the
regex literals of a Lark grammar) without parsing any of them exactly: escapes (`\\p{L}`, `\\x{41}`) and
classes (`[[:alpha:]&&[^x]]`) are single atoms, group prefixes (`(?P<name>`) count as a few atoms, and a `{`
that starts no quantifier is an atom. Each of these errs by a few atoms, never by a factor. Counts saturate
at the bound, so the arithmetic stays small whatever the digits. One pass, no recursion (nesting depth costs
nothing here; llguidance refuses deep nesting itself).
"""

from __future__ import annotations

import json
import re

_QUANTIFIER = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")
_ESCAPE_WITH_BRACES = frozenset("pPxuNg")  # \p{L}, \x{41}, \u{263A}, \N{...}, \g{1}


def regex_expansion(pattern: str, bound: int) -> int:
    """Atoms of `pattern` with its counted repetitions written out (see the module docstring), saturated at
    `bound + 1`: a result above `bound` means "too large"."""
    cap = bound + 1
    frames: list[list[int]] = []  # enclosing groups: [branches done, sequence so far, last atom]
    done, seq, last = 0, 0, 0  # the current group's
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        atom = 1
        if c == "\\":
            i += 2
            if i < n and pattern[i - 1] in _ESCAPE_WITH_BRACES and pattern[i] == "{":
                end = pattern.find("}", i)
                i = n if end < 0 else end + 1
        elif c == "[":
            i = _class_end(pattern, i)
        elif c == "(":
            frames.append([done, seq, last])
            done, seq, last = 0, 0, 0
            i += 1
            continue
        elif c == ")" and frames:
            atom = min(done + seq, cap)
            done, seq, _ = frames.pop()
            i += 1
        elif c == "|":
            done, seq, last = min(done + seq, cap), 0, 0
            i += 1
            continue
        elif c == "{" and (m := _QUANTIFIER.match(pattern, i)):
            low, comma, high = m.groups()
            count = _count(high) if comma and high else _count(low)
            seq = min(seq + last * (count - 1), cap) if count > 0 else seq
            last = min(last * max(count, 1), cap)
            i = m.end()
            continue
        elif c in "*+?":
            i += 1
            continue
        else:
            i += 1
        seq, last = min(seq + atom, cap), atom
    total = done + seq
    while frames:  # an unclosed group (llguidance refuses it; the size still counts)
        outer_done, outer_seq, _ = frames.pop()
        total = outer_done + outer_seq + total
    return min(total, cap)


def _count(digits: str) -> int:
    """A repetition count, saturated: more than nine digits reads as a billion (past any bound)."""
    return int(digits) if len(digits) <= 9 else 10**9


def _class_end(pattern: str, start: int) -> int:
    """The index after the `]` that closes the class opening at `start` (nested classes and escapes skipped;
    a `]` first in the class is a member, as in both dialects)."""
    i, n, depth = start + 1, len(pattern), 1
    if i < n and pattern[i] == "^":
        i += 1
    if i < n and pattern[i] == "]":
        i += 1
    while i < n and depth:
        c = pattern[i]
        if c == "\\":
            i += 1
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        i += 1
    return i


LARK_REGEX = re.compile(r"/((?:\\.|[^/\\\n])+)/[imslux]*")  # a regex literal of a Lark grammar
LARK_JSON = re.compile(r"%json\s*(?=\{)")  # llguidance's inline JSON Schema rule: %json { ... }


def lark_regexes(grammar: str) -> list[str]:
    """The regex literals (`/.../flags`) of a Lark grammar, where its lazily compiled lexemes are. (A GBNF
    grammar's repetitions are rules: llguidance expands them at compile time, bounded by its grammar size.)"""
    return LARK_REGEX.findall(grammar)


def lark_schemas(grammar: str) -> list[object]:
    """The inline JSON Schemas (`%json {...}`) of a Lark grammar (a forced tool call's grammar holds the tool's
    `parameters` so). Raises ValueError for one that is not JSON or nests too deep to read."""
    decoder = json.JSONDecoder()
    out = []
    for m in LARK_JSON.finditer(grammar):
        try:
            out.append(decoder.raw_decode(grammar, m.end())[0])
        except RecursionError:
            raise ValueError("a %json schema nests too deep") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"a %json schema is not valid JSON ({e.msg})") from None
        except ValueError:  # int() past its 4,300 digits
            raise ValueError("a %json schema holds a number too long to read") from None
    return out


def schema_patterns(schema: object) -> list[tuple[str, str]]:
    """(where, regex) of every regex in a JSON Schema: each `pattern` string and each `patternProperties` key,
    found by an iterative walk (the schema's depth is bounded before it gets here)."""
    out: list[tuple[str, str]] = []
    stack: list[tuple[object, str]] = [(schema, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, dict):
            if isinstance(value.get("pattern"), str):
                out.append((f"{where}.pattern", value["pattern"]))
            if isinstance(props := value.get("patternProperties"), dict):
                out.extend((f"{where}.patternProperties", key) for key in props)
            stack.extend((v, f"{where}.{k}") for k, v in value.items() if isinstance(v, dict | list))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{j}]") for j, v in enumerate(value) if isinstance(v, dict | list))
    return out
