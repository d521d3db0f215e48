"""Template bombs: a chat template is untrusted code (it ships with a downloaded model), so its render is
bounded in time, output and the size of anything it builds, and every failure is a ChatTemplateError.

Before: `'a' * 200000000` built 200 MB, `[1] * 100000000` 810 MB, `10 ** 10000000` took 18.7 s of CPU,
nested range loops ran for minutes, a recursive macro ended in a RecursionError (HTTP 500), and
`chat_template_kwargs` naming a template function (`namespace`, `range`...) raised a TypeError.
"""

from __future__ import annotations

import time
import tracemalloc

import pytest

from paged_jax.tokenization.chat_template import ChatTemplateError, render, template_from_text
from paged_jax.tokenization.template_sandbox import RenderLimits

MESSAGES = [{"role": "user", "content": "hi"}]
DOUBLE_40 = "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s OP ns.s %}{% endfor %}"
BOMBS = {
    "string-repeat": "{{ 'a' * 200000000 }}",
    "list-repeat": "{{ ([1] * 100000000)|length }}",
    "power": "{{ 10 ** 10000000 }}",
    "power-chain": "{{ (9 ** 9) ** (9 ** 9) }}",
    "product-chain": "{% set ns = namespace(x=2) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "concat-doubling": DOUBLE_40.replace("OP", "~"),
    "plus-doubling": DOUBLE_40.replace("OP", "+"),
    "macro-doubling": "{% macro f(s, n) %}{{ f(s ~ s, n - 1) if n else s|length }}{% endmacro %}{{ f('a', 40) }}",
    "center-filter": "{{ 'a'|center(1000000000) }}",
    "indent-filter": "{{ 'a\nb'|indent(1000000000) }}",
    "ljust-method": "{{ 'a'.ljust(1000000000) }}",
    "percent-format": "{{ '%1000000000d' % 1 }}",
    "format-method": "{{ '{:>1000000000}'.format(1) }}",
    "recursive-macro": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "huge-range": "{% for i in range(1000000000) %}{% endfor %}",
    "range-not-int": "{% for i in range('x') %}{% endfor %}",
    "type-error": "{{ 1 + 'a' }}",
    "output-bomb": "{% for i in range(100000) %}{% for j in range(1000) %}{{ 'abcdefgh' }}{% endfor %}{% endfor %}",
}
# One filter call the deadline cannot stop (issue 41): each refused from its arguments before it runs.
ARGUMENT_BOMBS = {
    "indent": ("{{ ('a\n' * 1000000)|indent(1000000) }}", "filter indent would build"),
    "wordwrap": ("{{ ('ab ' * 5000000)|wordwrap(1) }}", "filter wordwrap: 15000000 characters of input"),
    "urlize": ("{{ ('a.com ' * 1000000)|urlize }}", "filter urlize"),
    "lipsum": ("{{ lipsum(20000) }}", "lipsum(20000"),
    "replace": ("{{ ('a' * 100000)|replace('a', 'b' * 1000) }}", "filter replace would build"),
    "join": ("{{ (['x' * 1000000] * 1000)|join }}", "filter join would build"),
    "slice": ("{{ [1]|slice(10000000)|list|length }}", "filter slice"),
    "tojson-indent": ("{{ [[1]]|tojson(indent=1000000) }}", "filter tojson: indent"),
    "format-filter": ("{{ '%1000000d'|format(1) }}", "filter format"),
}
BOMBS.update({f"arg-{name}": source for name, (source, _) in ARGUMENT_BOMBS.items()})


@pytest.mark.parametrize("source", BOMBS.values(), ids=BOMBS.keys())
def test_template_bombs_are_template_errors(source: str) -> None:
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ChatTemplateError, match="^(messages|chat_template): "):
            render(template_from_text(source), MESSAGES, {})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 10.0
    assert peak < 200 * 2**20, f"{peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("name", ARGUMENT_BOMBS)
def test_filters_are_refused_from_their_arguments_before_they_run(name: str, monkeypatch) -> None:
    """Refused before the filter runs: the filter itself would be reached only through jinja2's code, so the
    check is that the error names the bound (not the deadline, which fires only between calls)."""
    source, words = ARGUMENT_BOMBS[name]
    with pytest.raises(ChatTemplateError) as e:
        render(template_from_text(source), MESSAGES, {}, limits=RenderLimits(timeout_s=1000.0))
    assert words in str(e.value) and "longer than" not in str(e.value), str(e.value)


def test_filters_within_their_bounds_still_work() -> None:
    source = (
        "{{ 'a\nb'|indent(2) }}|{{ 'aa bb'|wordwrap(2) }}|{{ 'xx'|replace('x', 'yy') }}|{{ ['a', 'b']|join(',') }}"
        "|{{ [1, 2, 3]|slice(2)|list|length }}|{{ [1]|tojson(indent=2) }}|{{ '%3d'|format(1) }}"
        "|{{ lipsum(1, html=False, min=3, max=4)|wordcount > 2 }}"
    )
    assert render(template_from_text(source), MESSAGES, {}) == "a\n  b|aa\nbb|yyyy|a,b|2|[\n  1\n]|  1|True"


def test_nested_loops_stop_at_the_deadline() -> None:
    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="longer than 0.5 s"):
        render(template_from_text(spin), MESSAGES, {}, limits=RenderLimits(timeout_s=0.5))
    assert time.perf_counter() - start < 5.0


def test_output_is_capped() -> None:
    source = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert render(template_from_text(source), [{"role": "user", "content": "x" * 100}], {}) == "x" * 100
    with pytest.raises(ChatTemplateError, match="longer than 50 characters"):
        render(
            template_from_text(source), [{"role": "user", "content": "x" * 100}], {}, limits=RenderLimits(max_chars=50)
        )


@pytest.mark.parametrize("name", ["namespace", "range", "raise_exception", "strftime_now", "cycler", "dict"])
def test_kwargs_cannot_shadow_template_functions(name: str) -> None:
    template = template_from_text("{% set ns = namespace(a=1) %}{{ raise_exception is defined }}{{ range(2)|list }}")
    with pytest.raises(ChatTemplateError, match=f"^chat_template_kwargs: {name} is a template function"):
        render(template, MESSAGES, {}, template_kwargs={name: 1})


@pytest.mark.parametrize("n", ["x", 10**9, 2.5, None])
def test_kwargs_fed_to_range_are_template_errors(n) -> None:
    template = template_from_text("{% for i in range(n) %}{{ i }}{% endfor %}")
    assert render(template, MESSAGES, {}, template_kwargs={"n": 3}) == "012"
    with pytest.raises(ChatTemplateError, match="^messages: .*range"):
        render(template, MESSAGES, {}, template_kwargs={"n": n})


def test_ordinary_template_features_still_work() -> None:
    source = (
        "{% set ns = namespace(count=0) %}{% for m in messages %}{% set ns.count = ns.count + 1 %}"
        "{{ '<' ~ m.role ~ '>' ~ m.content|trim ~ '\n' }}{% endfor %}{{ ns.count }}{{ range(3)|list|length }}"
        "{{ (2 ** 10) }}{{ 'ab' * 2 }}{{ '%05d' % 7 }}{{ '{:>4}'.format(1) }}{{ 'x'|center(5) }}"
        "{{ range(3)|reverse|list }}"
        "{{ (messages|map(attribute='role')|list)|tojson }}"
    )
    out = render(template_from_text(source), [*MESSAGES, {"role": "assistant", "content": " yo "}], {})
    assert out == '<user>hi\n<assistant>yo\n231024abab00007   1  x  [2, 1, 0]["user", "assistant"]'
