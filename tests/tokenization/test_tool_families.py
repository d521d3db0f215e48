"""Every tool-call family end to end on the tiny byte tokenizer: a template of the family renders a history call
in the model's format, the format's parser reads it back to the same call, the forced-call grammar accepts
exactly that text, and the stream (cut everywhere) gives the same content and calls as the whole reply."""

from __future__ import annotations

import json

import pytest

from paged_jax.tokenization.chat_template import render, template_from_text
from paged_jax.tokenization.tokenizer import ByteTokenizer
from paged_jax.tokenization.tool_calls import (
    FORMATS,
    function_specs,
    generic_tool_prompt,
    history_tool_calls,
    reads_tools,
    tool_format,
    with_tool_prompt,
)
from serve.openai_api.responses import ToolDelta, ToolStream

USER = "{% for m in messages %}{% if m.role == 'user' %}<u>{{ m.content }}</u>{% else %}{{ m.content }}"
END = "{% endif %}{% endfor %}"
# Each family's assistant tool-call rendering, as its models' chat templates write it (with `tools` read).
TEMPLATES = {
    "hermes": USER + "{% for tc in m.tool_calls or [] %}<tool_call>\n{{ tc.function | tojson }}\n</tool_call>"
    "{% endfor %}" + END + "{{ tools | length }}",
    "qwen3_coder": USER + "{% for tc in m.tool_calls or [] %}<tool_call>\n<function={{ tc.function.name }}>\n"
    "{% for k, v in tc.function.arguments | items %}<parameter={{ k }}>\n{{ v if v is string else v | tojson }}\n"
    "</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}" + END + "{{ tools | length }}",
    "llama3": "<|start_header_id|>{{ tools | length }} parameters"
    + USER
    + '{% for tc in m.tool_calls or [] %}<|python_tag|>{"name": "{{ tc.function.name }}", "parameters": '
    "{{ tc.function.arguments | tojson }}}{% endfor %}" + END,
    "mistral": USER + '{% if m.tool_calls %}[TOOL_CALLS][{% for tc in m.tool_calls %}{"name": '
    '"{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}{% if not loop.last %}, '
    "{% endif %}{% endfor %}]{% endif %}" + END + "{{ tools | length }}",
    "deepseek_v3": USER + "{% if m.tool_calls %}<｜tool▁calls▁begin｜>{% for tc in m.tool_calls %}"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ tc.function.name }}\n```json\n{{ tc.function.arguments | tojson }}"
    "\n```<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% endif %}" + END + "{{ tools | length }}",
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}, "days": {"type": "integer"}},
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CALLS = [
    {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}
    for i, args in enumerate([{"city": "Oslo", "unit": "C", "days": 3}, {"city": "Rome", "unit": "F", "days": 1}])
]
TOK = ByteTokenizer()


def _reply(family: str, calls: list, content: str = "") -> str:
    """The model-format text of an assistant reply with `calls`, as the family's template renders it."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": content, "tool_calls": history_tool_calls(calls, "tool_calls")},
    ]
    text = render(template_from_text(TEMPLATES[family]), messages, {}, add_generation_prompt=False, tools=TOOLS)
    return text.split("</u>", 1)[1].removesuffix("1")


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_render_parse_back_and_stream(family):
    fmt = tool_format(template_from_text(TEMPLATES[family]))
    assert fmt is not None and fmt.name == family
    calls = CALLS if family != "llama3" else CALLS[:1]  # Llama 3.1 makes one call per reply
    text = _reply(family, calls, "Checking." if family not in ("llama3",) else "")
    parsed = fmt.parse(text)
    expected = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == expected, text
    assert parsed.content == ("Checking." if family != "llama3" else None)
    unary = [(c.name, c.arguments) for c in parsed.tool_calls]
    for cut in range(len(text) + 1):  # the stream: content up to where a call may begin, then the calls
        stream = ToolStream(fmt)
        pieces = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
        assert _assembled([d for _, deltas in pieces for d in deltas]) == unary, cut
        assert "".join(p[0] for p in pieces).strip() == (parsed.content or ""), cut


def _assembled(deltas: list[ToolDelta]) -> list[tuple[str, str]]:
    """The calls that streamed pieces make, as a client joins them: each head (with no arguments yet) before any
    piece of its arguments, and the calls in order."""
    calls: list[list[str]] = []
    for d in deltas:
        if d.call is not None:
            assert d.index == len(calls) and d.call.arguments == "" and not d.arguments
            calls.append([d.call.name, ""])
        else:
            assert 0 <= d.index == len(calls) - 1 and d.arguments  # the call under way, never an empty piece
            calls[d.index][1] += d.arguments
    return [(name, args) for name, args in calls]


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_arguments_stream_in_pieces_that_join_to_the_unary_ones(family):
    """Fed a few characters at a time (as tokens arrive), each call's head comes first and its arguments follow
    over several feeds, before the call is complete; the pieces join to the unary arguments exactly."""
    fmt = FORMATS[family]
    calls = CALLS if family != "llama3" else CALLS[:1]
    text = _reply(family, calls, "Checking." if family != "llama3" else "")
    unary = [(c.name, c.arguments) for c in fmt.parse(text).tool_calls]
    for step in (1, 3, 7):
        stream = ToolStream(fmt)
        feeds = [stream.feed(text[i : i + step])[1] for i in range(0, len(text), step)]
        feeds.append(stream.finish()[1])
        assert _assembled([d for deltas in feeds for d in deltas]) == unary, step
        for k in range(len(unary)):
            with_args = [j for j, deltas in enumerate(feeds) if any(d.index == k and d.arguments for d in deltas)]
            assert len(with_args) >= 3, (family, step, k)  # the arguments arrive over several feeds
            assert with_args[0] < len(feeds) - 1  # and they begin before the reply ends


def test_arguments_written_by_the_model_are_kept_as_written():
    """A call's arguments are the model's JSON text (spacing, key order, numbers as written), streamed or not;
    arguments given as a JSON string are that string's object."""
    text = '<tool_call>\n{"name": "f", "arguments": {"b":1.50,  "a" :[1,{"x":"}"}]}}\n</tool_call>'
    assert [c.arguments for c in FORMATS["hermes"].parse(text).tool_calls] == ['{"b":1.50,  "a" :[1,{"x":"}"}]}']
    quoted = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    assert [c.arguments for c in FORMATS["hermes"].parse(quoted).tool_calls] == ['{"a": 1}']
    for reply in (text, quoted):
        stream = ToolStream(FORMATS["hermes"])
        deltas = [d for i in range(len(reply)) for d in stream.feed(reply[i])[1]] + stream.finish()[1]
        assert _assembled(deltas) == [(c.name, c.arguments) for c in FORMATS["hermes"].parse(reply).tool_calls]
    cut = '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": [2'  # cut off: what was sent stays
    stream = ToolStream(FORMATS["hermes"])
    content, deltas = stream.feed("Hi " + cut)
    assert stream.finish() == ("", []) and content == "Hi "  # no piece of the call goes out as content
    assert _assembled(deltas) == [("f", '{"a": 1, "b": [2')] and FORMATS["hermes"].parse(cut).tool_calls == []


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_the_forced_grammar_accepts_the_family_text(family):
    from paged_jax.structured import LLGuidanceBackend

    fmt = FORMATS[family]
    backend = LLGuidanceBackend(TOK, 512, TOK.eos_token_ids)
    matcher = backend.matcher(fmt.grammar(function_specs(TOOLS)))
    text = _reply(family, CALLS[:1]).removeprefix("<|python_tag|>")  # Llama's forced call is the bare JSON form
    assert all(matcher.accept(t) for t in TOK.encode(text, add_special_tokens=False)), (text, matcher.error)
    assert matcher.accept(TOK.eos_token_ids[0]) or matcher.is_stopped


def test_a_template_without_tools_gets_the_generic_form():
    plain = template_from_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert not reads_tools(plain) and tool_format(plain) is None
    assert reads_tools(template_from_text(TEMPLATES["hermes"]))
    messages = with_tool_prompt([{"role": "user", "content": "Hi"}], TOOLS)
    assert messages[0] == {"role": "system", "content": generic_tool_prompt(TOOLS)}
    assert json.dumps(TOOLS[0]) in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    merged = with_tool_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], TOOLS)
    assert merged[0]["content"].startswith("Be brief.\n\n") and len(merged) == 2
    assert tool_format(plain, "mistral").name == "mistral" and tool_format(plain, "none") is None
    with pytest.raises(ValueError, match="^tool_call_parser: "):
        tool_format(plain, "pythonic")


def test_malformed_family_text_stays_text():
    for family, text in [
        ("mistral", "[TOOL_CALLS][{not json}]"),
        ("deepseek_v3", "<｜tool▁calls▁begin｜>garbage<｜tool▁calls▁end｜>"),
        ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=x>\n1"),
    ]:
        parsed = FORMATS[family].parse(text)
        assert parsed.tool_calls == [] and parsed.content == text
    parsed = FORMATS["mistral"].parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}')  # newer tokenizers' form
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city": "Oslo"}')]
