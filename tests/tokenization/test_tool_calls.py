"""Tool calls: the chat-template families' formats (Hermes / Qwen `<tool_call>`, Llama-3 JSON), forced calls as
grammars, replies parsed into OpenAI `tool_calls` (unary and streamed, with the `openai` client), and tool calls in
the history rendered through the chat template."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from paged_jax.engine.input_processor import ChatPrompt, chat_prompt_ids
from paged_jax.tokenization.chat_template import template_from_text
from paged_jax.tokenization.tool_calls import FORMATS, history_tool_calls, tool_format
from serve.openai_api.responses import ToolStream

from support.serve_support import shared

HERMES_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}'
    "</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
PLAIN_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}<assistant>"
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


# -- formats --------------------------------------------------------------------------------------------------
TEMPLATE = HERMES_TEMPLATE  # the chat template of the shared `fronts` fixture (tests/conftest.py)


def test_families_are_found_in_the_template_text():
    assert tool_format(template_from_text(HERMES_TEMPLATE)).name == "hermes"
    llama = "<|start_header_id|>{% if tools %}{{ tools }} parameters{% endif %}<|python_tag|>"
    assert tool_format(template_from_text(llama)).name == "llama3"
    assert tool_format(template_from_text(PLAIN_TEMPLATE)) is None and tool_format(None) is None


def test_hermes_parse():
    fmt = FORMATS["hermes"]
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    reply = fmt.parse(
        text + '\n<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}\n</tool_call>'
    )
    assert reply.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}),
        ("get_time", {"zone": "UTC"}),
    ]
    assert len({c.id for c in reply.tool_calls}) == 2
    assert fmt.parse("just text").tool_calls == [] and fmt.parse("just text").content == "just text"
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert fmt.parse(broken).tool_calls == [] and fmt.parse(broken).content == broken


def test_llama3_parse():
    fmt = FORMATS["llama3"]
    reply = fmt.parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}')
    assert reply.content is None and [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("get_time", {"zone": "CET"})
    ]
    assert fmt.parse("The weather is fine.").tool_calls == []


DEEP_ARGS = "[" * 3000 + "]" * 3000


@pytest.mark.parametrize(
    ("family", "reply"),
    [
        ("hermes", '<tool_call>\n{"name": "f", "arguments": ' + DEEP_ARGS + "}\n</tool_call>"),
        ("hermes", '<tool_call>\n{"name": "f", "arguments": "' + DEEP_ARGS + '"}\n</tool_call>'),
        ("llama3", '{"name": "f", "parameters": {"x": ' + DEEP_ARGS + "}}"),
        ("llama3", '{"name": "f", "parameters": "' + DEEP_ARGS + '"}'),
        ("llama3", '{"name": "f", "parameters": {"x": ' + "7" * 5000 + "}}"),
    ],
)
def test_deep_or_huge_json_in_a_reply_stays_text(family, reply):
    """A reply nested thousands deep (or with an integer past int()'s digits) was a RecursionError (HTTP 500);
    it is the reply's text, with no calls."""
    parsed = FORMATS[family].parse(reply)
    assert parsed.tool_calls == [] and parsed.content == reply


def test_text_between_and_after_calls_is_kept():
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    reply = FORMATS["hermes"].parse(f"hi {call} mid {call} end")
    assert reply.content == "hi\nmid\nend" and [c.name for c in reply.tool_calls] == ["f", "f"]
    reply = FORMATS["llama3"].parse('{"name": "f", "parameters": {"a": ";"}}; {"name": "g", "parameters": {}} done')
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("f", {"a": ";"}), ("g", {})]
    assert reply.content == "done"
    s = ToolStream(FORMATS["hermes"])
    content, pieces = s.feed(f"hi {call} mid")
    assert content == "hi " and [(d.index, d.call.name if d.call else d.arguments) for d in pieces] == [
        (0, "f"),
        (0, "{}"),
    ]  # sent as soon as it is complete
    rest, more = s.finish()
    assert rest == "mid" and more == []
    broken = FORMATS["hermes"].parse(f"{call} <tool_call>\n{{bad}}\n</tool_call>")  # a malformed block is text
    assert [c.name for c in broken.tool_calls] == ["f"] and broken.content == "<tool_call>\n{bad}\n</tool_call>"


def test_stream_holds_back_text_from_where_a_call_may_begin():
    s = ToolStream(FORMATS["hermes"])
    assert s.feed("Sure, ") == ("Sure, ", [])
    assert s.feed("<tool") == ("", [])  # could be the start of <tool_call>
    content, pieces = s.feed('_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    assert content == "" and pieces[0].call.name == "get_time" and pieces[1].arguments == '{"zone": "UTC"}'
    assert s.finish() == ("", [])
    s = ToolStream(FORMATS["hermes"])
    assert s.feed("a <to") == ("a ", []) and s.feed("day") == ("<today", [])
    assert s.finish() == ("", [])


def test_history_tool_calls_take_json_text_arguments():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    assert history_tool_calls(calls, "messages[1].tool_calls")[0]["function"]["arguments"] == {"x": 1}
    with pytest.raises(ValueError, match=r"^messages\[1\].tool_calls\[0\].function.arguments: not valid JSON"):
        history_tool_calls([{"function": {"name": "f", "arguments": "{"}}], "messages[1].tool_calls")


# -- the OpenAI front -------------------------------------------------------------------------------------------


def _check_calls(calls, names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_tool_choice_return_parsed_calls(oai):
    for seed in range(3):
        r = oai.chat.completions.create(
            model=None, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=1.0, seed=seed
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        _check_calls(c.message.tool_calls, SCHEMAS)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = oai.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=80, seed=1)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message.tool_calls, {"get_time"})
    assert len(r.choices[0].message.tool_calls) == 1


def test_streamed_tool_calls(oai):
    """Each call as OpenAI streams it (index, id and name first, then its arguments in pieces over several chunks,
    one call piece per chunk), reassembled to the calls of the same request unstreamed."""
    args = dict(model=None, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, seed=4)
    calls, reasons, content, pieces = {}, [], "", 0
    for chunk in oai.chat.completions.create(stream=True, **args):
        for ch in chunk.choices:
            assert len(ch.delta.tool_calls or []) <= 1
            pieces += bool(ch.delta.tool_calls and ch.delta.tool_calls[0].function.arguments)
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.index not in calls:  # its first delta: id and name, no arguments yet
                    assert tc.id.startswith("call_") and tc.function.name and not tc.function.arguments
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert reasons == ["tool_calls"] and "<tool_call>" not in content and calls and pieces >= 3
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])
    whole = oai.chat.completions.create(**args).choices[0].message.tool_calls
    assert [calls[k] for k in sorted(calls)] == [
        {"name": t.function.name, "arguments": t.function.arguments} for t in whole
    ]


def test_auto_lets_the_model_choose_and_text_stays_content(oai):
    r = oai.chat.completions.create(model=None, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0.0)
    c = r.choices[0]
    if c.message.tool_calls:  # the random tiny model wrote a whole call: it was parsed
        _check_calls(c.message.tool_calls, SCHEMAS)
    else:
        assert c.finish_reason in ("stop", "length") and isinstance(c.message.content, str)


def test_tool_history_renders_through_the_template(oai, fronts):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    r = oai.chat.completions.create(model=None, messages=history, tools=TOOLS, max_tokens=4, temperature=0.0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tok = shared().engine.tokenizer
    calls = history_tool_calls(history[1]["tool_calls"], "messages[1].tool_calls")
    chat = ChatPrompt([ASK[0], {"role": "assistant", "content": "", "tool_calls": calls}])
    text = tok.decode(chat_prompt_ids(tok, chat))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>' in text


def test_tool_choice_errors_name_the_parameter(oai):
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}), "tool_choice.function.name"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"parameters": {}}}]), "tools[0].function.name"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
        (dict(messages=ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]),
         "messages[1].tool_calls[0].function.arguments"),
    ]  # fmt: skip
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(**({"model": None, "messages": ASK, "max_tokens": 4} | kwargs))
        assert e.value.body["param"] == param, (kwargs, e.value.body)


def test_a_template_without_tools_gets_the_generic_form_and_forced_calls_work(oai):
    """SmolLM2's case: a template with no tools section. The tools are described in a system message of the
    generic form and a forced call is grammar-constrained and parsed as ever."""
    tokenizer = shared().engine.tokenizer
    old, tokenizer.chat_template = tokenizer.chat_template, template_from_text(PLAIN_TEMPLATE, "plain")
    try:
        named = {"type": "function", "function": {"name": "get_time"}}
        r = oai.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=80)
        assert r.choices[0].finish_reason == "tool_calls"
        _check_calls(r.choices[0].message.tool_calls, {"get_time"})
        prompt = oai.chat.completions.create(model=None, messages=ASK, tools=TOOLS, max_tokens=1).usage.prompt_tokens
        plain = oai.chat.completions.create(model=None, messages=ASK, max_tokens=1).usage.prompt_tokens
        assert prompt > plain + len(json.dumps(TOOLS[0]))  # the tools went into the prompt
    finally:
        tokenizer.chat_template = old


def test_a_template_that_reads_tools_in_no_family_refuses_a_forced_call(oai):
    tokenizer = shared().engine.tokenizer
    reads = "{% if tools %}[{{ tools | length }} tools]{% endif %}" + PLAIN_TEMPLATE
    old, tokenizer.chat_template = tokenizer.chat_template, template_from_text(reads, "reads tools")
    try:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=4)
        assert e.value.body["param"] == "tool_choice" and "no tool-call family" in e.value.body["message"]
        r = oai.chat.completions.create(model=None, messages=ASK, tools=TOOLS, max_tokens=4)  # auto: plain text
        assert r.choices[0].message.tool_calls is None
    finally:
        tokenizer.chat_template = old
