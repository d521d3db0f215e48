"""POST /v1/responses (and GET / DELETE /v1/responses/{id}) through the official `openai` client against the
shared tiny model's HTTP front: the same replies as the chat path for the same conversation (string and item
input, instructions), a named tool_choice forcing a call (the generic tool form, grammar-constrained), a
json_schema text format, a thought as a reasoning item, streaming (the semantic events in order, reassembled to
the unary result), previous_response_id chaining, the store (GET, DELETE, store false, unknown ids: 404) and bad
input refused naming the parameter."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from paged_jax.tokenization.chat_template import template_from_text
from serve.openai_api.responses_api import ResponseStore, Stored

from support.serve_support import shared

# No tools section (tools come in the generic form, parsed as hermes) and no thought.
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Qwen3.5's generation prompt: the thought opened in the prompt (past turns' thoughts dropped).
THINKING = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content.split('</think>')[-1] }}</{{ m.role }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant><think>\n{% endif %}"
)
A_BIAS = {"100": 100}  # the byte tokenizer's "a": a thought of a's (the random model's own may be empty text)
GREEDY = dict(model=None, temperature=0.0, max_output_tokens=12)
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]


def _chat(oai, messages, max_tokens=12, **kwargs):
    return oai.chat.completions.create(model=None, messages=messages, temperature=0.0, max_tokens=max_tokens, **kwargs)


def test_string_items_and_instructions_answer_as_chat_does(oai):
    r = oai.responses.create(input="Hello", **GREEDY)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.id.startswith("resp_")
    c = _chat(oai, [{"role": "user", "content": "Hello"}])
    assert r.output_text == c.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    parts = [{"type": "input_text", "text": "Hi "}, {"type": "input_text", "text": "there"}]
    items = [{"role": "developer", "content": "Be brief."}, {"type": "message", "role": "user", "content": parts}]
    r = oai.responses.create(input=items, instructions="You are terse.", **GREEDY)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    c = _chat(oai, messages)
    assert r.output_text == c.choices[0].message.content and r.usage.input_tokens == c.usage.prompt_tokens
    assert r.instructions == "You are terse."


def test_a_named_tool_choice_forces_a_call_and_its_output_goes_back(oai):
    r = oai.responses.create(
        input="Weather in Paris?", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
        model=None, temperature=0.0, max_output_tokens=200,
    )  # fmt: skip
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    streamed = _stream_events(
        oai, input="Weather in Paris?", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
        model=None, temperature=0.0, max_output_tokens=200,
    )  # fmt: skip
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [(calls[0].name, calls[0].arguments)]
    deltas = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert deltas == calls[0].arguments
    follow = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
    ]
    r2 = oai.responses.create(input=follow, tools=TOOLS, tool_choice="none", **GREEDY)
    assert r2.status in ("completed", "incomplete") and r2.output[0].type == "message"


def test_json_schema_text_format(oai):
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}}
    r = oai.responses.create(input="A number", text=fmt, model=None, temperature=1.0, max_output_tokens=60)
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


def _stream_events(oai, **kwargs):
    events = list(oai.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    return events


def test_streaming_reassembles_to_the_unary_result(oai):
    r = oai.responses.create(input="Once upon", **GREEDY)
    events = _stream_events(oai, input="Once upon", **GREEDY)
    kinds = [e.type for e in events]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens
    with oai.responses.stream(input="Once upon", **GREEDY) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == r.output_text


def test_a_thought_is_a_reasoning_item(oai):
    tokenizer = shared().engine.tokenizer
    old, tokenizer.chat_template = tokenizer.chat_template, template_from_text(THINKING, "thinking")
    try:
        extra = {"max_reasoning_tokens": 4, "logit_bias": A_BIAS}
        args = dict(input="Hi", model=None, temperature=0.0, max_output_tokens=20, extra_body=extra)
        r = oai.responses.create(**args)
        assert [i.type for i in r.output] == ["reasoning", "message"]
        thought = r.output[0].content[0].text
        assert thought == "aaaa" and "</think>" not in r.output_text
        events = _stream_events(oai, **args)
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    finally:
        tokenizer.chat_template = old


def test_previous_response_id_continues_the_conversation(oai):
    first = oai.responses.create(input="Hello", **GREEDY)
    second = oai.responses.create(input="And then?", previous_response_id=first.id, **GREEDY)
    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    c = _chat(oai, messages)
    assert second.usage.input_tokens == c.usage.prompt_tokens and second.output_text == c.choices[0].message.content
    assert second.previous_response_id == first.id
    third = oai.responses.create(input="More", previous_response_id=second.id, **GREEDY)  # two turns back
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_the_store_get_delete_and_store_false(oai):
    r = oai.responses.create(input="Hello", **GREEDY)
    got = oai.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    oai.responses.delete(r.id)
    for call in (lambda: oai.responses.retrieve(r.id), lambda: oai.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(input="x", previous_response_id=r.id, **GREEDY)
    assert e.value.body["param"] == "previous_response_id" and r.id in e.value.body["message"]
    unkept = oai.responses.create(input="Hello", store=False, **GREEDY)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unkept.id)
    events = _stream_events(oai, input="Hello", **GREEDY)  # a streamed response is stored too
    assert oai.responses.retrieve(events[-1].response.id).output_text == events[-1].response.output_text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": []}, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
        ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"input": "x", "bogus": 1}, "bogus"),
        ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
    ],
)
def test_bad_input_is_refused_naming_the_parameter(oai, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.post("/responses", body={"model": None, **body}, cast_to=object)
    assert e.value.body["param"] == param and e.value.body["message"].startswith(param), e.value.body


def test_the_store_is_bounded_least_recently_used_first():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(Stored({"id": name}, []))
    assert store.get("a") is not None  # "a" used last: "b" goes first
    store.put(Stored({"id": "c"}, []))
    assert len(store) == 2 and store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert store.delete("a") and not store.delete("a") and len(store) == 1
