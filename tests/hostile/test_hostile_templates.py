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
