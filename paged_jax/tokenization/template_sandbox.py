"""How a chat template runs: jinja2's immutable sandbox, bounded in time, output and the size of what it builds.

jinja2's sandbox stops escapes (no attribute of `__class__`, no mutation of lists and dicts) but bounds
neither time nor memory: `'a' * 200000000` builds 200 MB, `10 ** 10000000` takes seconds of CPU, nested
`range` loops run for minutes, a recursive macro ends in a `RecursionError`. A template comes with the
model (`tokenizer_config.json` of a downloaded directory), so it is treated as untrusted code:

- every operator that can build something large (`*`, `**`, `+`, `~`, `%`) checks its result's size
  before computing it (`RenderLimits.max_value_chars` characters or items, `max_int_bits` bits);
- every call and filter refuses an integer argument above `max_value_chars` (`'a'.ljust(10**9)`,
  `'a'|center(10**9)`) and any str/list argument or result larger than it; `range` is capped at
  `max_range` items; `namespace()` attributes are size-checked when set;
- the filters whose work grows with an argument are refused from their arguments before they run (one
  Python call cannot be stopped by the deadline): `indent` by the size it would build (lines x width),
  `replace` and `join` likewise, `wordwrap` and `urlize` (Python work per word) by their input
  (`MAX_TEXT_FILTER_CHARS`), `slice`/`batch` by their count, `tojson` by its indent, `format` by its widths,
  and the `lipsum` global by its words (`MAX_LIPSUM_WORDS`);
- the deadline (`timeout_s`) is checked at every call, operator, `range` step and output chunk, and the
  output is streamed and refused past `max_chars`;
- any failure while compiling or rendering (syntax, `raise_exception`, the sandbox, a `TypeError`, a
  `RecursionError`, an overflow) is a `TemplateError`, which the caller turns into a request error.

The limits of the render in progress live in a context variable: the compiled environment is shared
by every thread that renders.
"""

from __future__ import annotations

import contextvars
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace


@dataclass(frozen=True, slots=True)
class RenderLimits:
    """Bounds of one render; the defaults are far above any real chat template's needs."""

    max_chars: int = 16 * 2**20  # characters of rendered output
    max_value_chars: int = 16 * 2**20  # characters (or items) of any one string or list the template builds
    max_int_bits: int = 8192  # integers the template computes (2466 decimal digits)
    max_range: int = 100_000  # items of one range() (jinja2's own sandbox cap)
    timeout_s: float = 5.0  # wall-clock time of one render


class TemplateBudgetError(TemplateError):
    """The template went past one of its `RenderLimits`."""


@dataclass(slots=True)
class _Budget:
    limits: RenderLimits
    deadline: float
    ticks: int = 0

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks % 256 == 0 and time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"rendering took longer than {self.limits.timeout_s:g} s")


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("template_budget")
_FORMAT_WIDTH = re.compile(r"\d{6,}")  # a width or precision of a million or more in a format spec


def _budget() -> _Budget:
    budget = _BUDGET.get(None)
    if budget is None:  # used outside `compile_template` / `render_bounded`: the default sizes, no deadline
        return _Budget(RenderLimits(), float("inf"))
    budget.tick()
    return budget


def _check_size(value: Any, what: str) -> Any:
    if isinstance(value, str | bytes | list | tuple | dict | set) and len(value) > _budget().limits.max_value_chars:
        raise TemplateBudgetError(f"{what} is larger than {_budget().limits.max_value_chars} items")
    if isinstance(value, int) and value.bit_length() > _budget().limits.max_int_bits:
        raise TemplateBudgetError(f"{what} is an integer of more than {_budget().limits.max_int_bits} bits")
    return value


def _check_arguments(args: tuple, kwargs: Mapping[str, Any], what: str) -> None:
    limit = _budget().limits.max_value_chars
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
            raise TemplateBudgetError(f"{what}: an integer argument above {limit}")
        _check_size(value, f"{what}: an argument")


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, str | bytes | list | tuple) else None


def _check_binop(operator: str, left: Any, right: Any) -> None:
    limits = _budget().limits
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "**" and ints and right > 0 and abs(left) > 1:
        if right * abs(left).bit_length() > limits.max_int_bits:
            raise TemplateBudgetError(f"{left} ** {right} is larger than {limits.max_int_bits} bits")
    elif operator == "*":
        if ints and left.bit_length() + right.bit_length() > limits.max_int_bits:
            raise TemplateBudgetError(f"a product larger than {limits.max_int_bits} bits")
        for seq, times in ((left, right), (right, left)):
            size = _size(seq)
            if size is not None and isinstance(times, int) and size * times > limits.max_value_chars:
                raise TemplateBudgetError(f"a repetition of more than {limits.max_value_chars} items")
    elif operator == "+" and (left_size := _size(left)) is not None and (right_size := _size(right)) is not None:
        if left_size + right_size > limits.max_value_chars:
            raise TemplateBudgetError(f"a concatenation of more than {limits.max_value_chars} items")
    elif operator == "%" and isinstance(left, str) and _FORMAT_WIDTH.search(left):
        raise TemplateBudgetError("a %-format with a width or precision of a million or more")


class _BoundedRange:
    """range() for templates: at most `max_range` items, integers only, the deadline checked as it iterates."""

    template_name = "range"

    def __init__(self, *args: Any) -> None:
        if not args or len(args) > 3 or not all(isinstance(a, int) and not isinstance(a, bool) for a in args):
            raise TemplateBudgetError(f"range() takes one to three integers, got {args!r:.80}")
        self._range = range(*args)
        if len(self._range) > _budget().limits.max_range:
            raise TemplateBudgetError(f"range() of {len(self._range)} items (at most {_budget().limits.max_range})")

    def __iter__(self) -> Iterator[int]:
        for i in self._range:
            _budget()
            yield i

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index: Any) -> Any:
        return self._range[index]

    def __contains__(self, item: Any) -> bool:
        return item in self._range

    def __reversed__(self) -> Iterator[int]:
        for i in reversed(self._range):
            _budget()
            yield i


class _BoundedNamespace(Namespace):
    """`namespace()`, whose attributes are size-checked as they are set (`{% set ns.s = ns.s ~ ns.s %}`)."""

    template_name = "namespace"

    def __setitem__(self, name: str, value: Any) -> None:
        super().__setitem__(name, _check_size(value, f"namespace attribute {name}"))


def _bounded_concat(parts: tuple) -> str:
    """The `~` operator: the strings' total length is checked before they are joined."""
    strings = [str(p) for p in parts]
    if sum(map(len, strings)) > _budget().limits.max_value_chars:
        raise TemplateBudgetError(f"a `~` concatenation of more than {_budget().limits.max_value_chars} characters")
    return "".join(strings)


class _BoundedCodeGenerator(CodeGenerator):
    """jinja2's code generator, with `~` compiled to `environment.bounded_concat` (it is not an intercepted binop)."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


MAX_TEXT_FILTER_CHARS = 2**20  # input of the filters that do Python work per word (wordwrap, urlize)
MAX_LIPSUM_WORDS = 10_000  # lipsum(n, max=...): n paragraphs of up to `max` words
MAX_SLICES = 100_000  # slice(n) builds n lists, batch(n) lists of n items
MAX_JSON_INDENT = 64  # tojson(indent=...)


def _width(value: Any) -> int:
    """What `indent` adds per line: an integer width, or a string's length."""
    return len(value) if isinstance(value, str) else value if isinstance(value, int) else 0


def _text(value: Any) -> str:
    return value if isinstance(value, str) else str(value) if isinstance(value, int | float) else ""


def _check_result_size(estimate: int, what: str) -> None:
    limit = _budget().limits.max_value_chars
    if estimate > limit:
        raise TemplateBudgetError(f"{what} would build about {estimate} characters (at most {limit})")


def _check_text_filter(name: str, s: Any) -> None:
    if len(_text(s)) > MAX_TEXT_FILTER_CHARS:
        raise TemplateBudgetError(
            f"filter {name}: {len(_text(s))} characters of input (at most {MAX_TEXT_FILTER_CHARS})"
        )


def _pre_indent(a: Mapping[str, Any]) -> None:
    s = _text(a.get("s"))
    _check_result_size(len(s) + (s.count("\n") + 1) * _width(a.get("width", 4)), "filter indent")


def _pre_wordwrap(a: Mapping[str, Any]) -> None:
    _check_text_filter("wordwrap", a.get("s"))
    width = a.get("width", 79)
    if isinstance(width, int) and not isinstance(width, bool) and width < 1:
        raise TemplateBudgetError("filter wordwrap: width must be at least 1")


def _pre_replace(a: Mapping[str, Any]) -> None:
    s, old, new = _text(a.get("s")), a.get("old"), a.get("new")
    if isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        count = s.count(old) if old else len(s) + 1
        if isinstance(a.get("count"), int) and a["count"] >= 0:
            count = min(count, a["count"])
        _check_result_size(len(s) + count * (len(new) - len(old)), "filter replace")


def _pre_join(a: Mapping[str, Any]) -> None:
    value, sep = a.get("value"), a.get("d", "")
    if isinstance(value, list | tuple) and a.get("attribute") is None:
        items = sum(len(v) if isinstance(v, str) else 24 for v in value)
        _check_result_size(items + max(len(value) - 1, 0) * len(_text(sep)), "filter join")


def _pre_tojson(a: Mapping[str, Any]) -> None:
    indent = a.get("indent")
    if isinstance(indent, int) and indent > MAX_JSON_INDENT:
        raise TemplateBudgetError(f"filter tojson: indent {indent} (at most {MAX_JSON_INDENT})")


def _pre_count(name: str, key: str) -> Any:
    def check(a: Mapping[str, Any]) -> None:
        n = a.get(key)
        if isinstance(n, int) and n > MAX_SLICES:
            raise TemplateBudgetError(f"filter {name}: {key} {n} (at most {MAX_SLICES})")

    return check


def _pre_format(a: Mapping[str, Any]) -> None:
    if isinstance(a.get("value"), str) and _FORMAT_WIDTH.search(a["value"]):
        raise TemplateBudgetError("filter format: a width or precision of a million or more")


# Filters whose work grows with an argument, checked from their arguments before they run (the deadline cannot
# stop one Python call): by jinja2's parameter names, bound to the call's arguments.
_PRECHECKS: dict[str, Any] = {
    "indent": _pre_indent,
    "wordwrap": _pre_wordwrap,
    "urlize": lambda a: _check_text_filter("urlize", a.get("value")),
    "replace": _pre_replace,
    "join": _pre_join,
    "tojson": _pre_tojson,
    "slice": _pre_count("slice", "slices"),
    "batch": _pre_count("batch", "linecount"),
    "format": _pre_format,
}


_CONTEXTS = frozenset({"eval_ctx", "environment", "env", "context"})


def bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 - jinja2's
    """jinja2's `lipsum` global, refused before it runs when `n` paragraphs of up to `max` words pass
    `MAX_LIPSUM_WORDS`."""
    from jinja2.utils import generate_lorem_ipsum

    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (n, min, max))
    if not ints or n < 0 or min < 1 or max < min or n * max > MAX_LIPSUM_WORDS:
        raise TemplateBudgetError(
            f"lipsum({n!r:.20}, min={min!r:.20}, max={max!r:.20}): at most {MAX_LIPSUM_WORDS} words"
        )
    return generate_lorem_ipsum(n, html, min, max)


bounded_lipsum.template_name = "lipsum"  # type: ignore[attr-defined]


def _bounded_filter(name: str, function: Any) -> Any:
    """`function` with its parameters (not the filtered value) and its result size-checked, and the filters of
    `_PRECHECKS` refused from their arguments before they run."""
    import functools
    import inspect

    pass_arg = getattr(function, "jinja_pass_arg", None)
    skip = 2 if pass_arg is not None else 1  # (context|environment|eval_ctx, value) or (value,)
    precheck = _PRECHECKS.get(name)
    signature = inspect.signature(function) if precheck is not None else None
    # jinja2's async variants pass the context but show the signature of the function they wrap, without it
    drop = int(pass_arg is not None and signature is not None and next(iter(signature.parameters)) not in _CONTEXTS)

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args[skip:], kwargs, f"filter {name}")
        if precheck is not None and signature is not None:
            try:
                bound = signature.bind(*args[drop:], **kwargs)
            except TypeError as e:
                raise TemplateError(f"filter {name}: {e}") from None
            precheck(bound.arguments)
        return _check_size(function(*args, **kwargs), f"the result of filter {name}")

    return bounded


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with `RenderLimits` enforced on operators, calls, filters, `~` and `range`."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals["range"] = _BoundedRange
        self.globals["namespace"] = _BoundedNamespace
        self.globals["lipsum"] = bounded_lipsum
        self.bounded_concat = _bounded_concat

    def bound_filters(self) -> None:
        """Wrap every filter registered so far (call after adding the caller's own)."""
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _check_size(super().call_binop(context, operator, left, right), f"the result of {operator}")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja2's names
        name = getattr(__obj, "template_name", None) or getattr(__obj, "__name__", type(__obj).__name__)
        _check_arguments(args, kwargs, f"{name}()")
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)  # the sandbox wraps str.format
        if name in ("format", "format_map") and isinstance(owner, str):
            if _FORMAT_WIDTH.search(owner):
                raise TemplateBudgetError("a format() with a width or precision of a million or more")
        return _check_size(super().call(__context, __obj, *args, **kwargs), f"the result of {name}()")


def compile_template(env: BoundedSandbox, source: str) -> jinja2.Template:
    """`env.from_string(source)`; any failure (syntax, a parser recursion) is a `TemplateError`."""
    token = _BUDGET.set(_Budget(RenderLimits(), time.monotonic() + RenderLimits().timeout_s))
    try:
        return env.from_string(source)
    except TemplateError:
        raise
    except Exception as e:  # noqa: BLE001 - a template is untrusted code: anything it does wrong is its error
        raise TemplateError(f"{type(e).__name__}: {str(e)[:200]}") from e
    finally:
        _BUDGET.reset(token)


def render_bounded(template: jinja2.Template, variables: Mapping[str, Any], limits: RenderLimits) -> str:
    """The template's output for `variables`, within `limits`; every failure is a `TemplateError`."""
    budget = _Budget(limits, time.monotonic() + limits.timeout_s)
    token = _BUDGET.set(budget)
    try:
        chunks, total = [], 0
        for chunk in template.generate(**variables):
            total += len(chunk)
            if total > limits.max_chars:
                raise TemplateBudgetError(f"the rendered prompt is longer than {limits.max_chars} characters")
            budget.tick()
            chunks.append(chunk)
        return "".join(chunks)
    except TemplateError:
        raise
    except RecursionError:
        raise TemplateError("recursion too deep (a macro calling itself, or input nested too deeply)") from None
    except Exception as e:  # noqa: BLE001 - see compile_template
        raise TemplateError(f"{type(e).__name__}: {str(e)[:200]}") from e
    finally:
        _BUDGET.reset(token)


__all__ = ["BoundedSandbox", "RenderLimits", "TemplateBudgetError", "compile_template", "render_bounded"]
