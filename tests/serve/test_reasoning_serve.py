"""Reasoning output on the OpenAI front with the official client: `reasoning_content` beside `content` (whole and
streamed, the stream reassembling to the whole reply), `chat_template_kwargs` reaching the template, the
`max_reasoning_tokens` budget, and structured output and forced tool calls applied to the answer only."""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest

from paged_jax.tokenization.chat_template import template_from_text
from serve.client import Client, build_request, chat_input

from support.serve_support import shared

# Qwen3.5's generation prompt (the thought opened in the prompt, or an empty one with enable_thinking false),
# with Hermes tool calls in the history: the families' real shapes on the tiny byte tokenizer.
TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content.split('</think>')[-1] }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>\n{{ tc.function | tojson }}\n</tool_call>{% endfor %}"
    "</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
A_BIAS = {"100": 100}  # the byte tokenizer's "a": a thought of a's (the random model's own may be empty text)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def _streamed(oai, **kwargs):
    reasoning, content, calls, reasons = "", "", {}, []
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    return reasoning or None, content or None, list(calls.values()), reasons


def test_the_budget_closes_the_thought_and_the_stream_matches(oai):
    args = dict(model=None, messages=ASK, max_tokens=30, temperature=0.0, max_reasoning_tokens=6, ignore_eos=True)
    r = oai.chat.completions.create(extra_body={k: args.pop(k) for k in ("max_reasoning_tokens", "ignore_eos")}, **args)
    m = r.choices[0].message
    assert m.reasoning_content is not None and len(m.reasoning_content.encode()) <= 6  # a byte is a token
    assert "</think>" not in (m.content or "") and r.usage.completion_tokens == 30
    streamed = _streamed(oai, extra_body={"max_reasoning_tokens": 6, "ignore_eos": True}, **args)
    assert streamed[:2] == (m.reasoning_content, m.content) and streamed[3] == ["length"]


def test_template_kwargs_turn_thinking_off(oai):
    r = oai.chat.completions.create(
        model=None, messages=ASK, max_tokens=8, temperature=0.0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    m = r.choices[0].message
    assert getattr(m, "reasoning_content", None) is None and m.content is not None


def test_structured_output_and_forced_calls_apply_to_the_answer(oai):
    r = oai.chat.completions.create(
        model=None, messages=ASK, max_tokens=200, temperature=1.0, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        logit_bias=A_BIAS, extra_body={"max_reasoning_tokens": 8},
    )  # fmt: skip
    m = r.choices[0].message
    assert m.reasoning_content == "a" * 8
    jsonschema.validate(json.loads(m.content), SCHEMA)
    args = dict(
        model=None,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        temperature=0.0,
        logit_bias=A_BIAS,
    )
    r = oai.chat.completions.create(extra_body={"max_reasoning_tokens": 5}, **args)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.reasoning_content == "a" * 5 and c.message.content is None
    call = c.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    reasoning, _, calls, reasons = _streamed(oai, extra_body={"max_reasoning_tokens": 5}, **args)
    assert reasoning == c.message.reasoning_content and reasons == ["tool_calls"]
    assert calls == [{"name": call.function.name, "arguments": call.function.arguments}]


def test_a_budget_on_a_model_that_does_not_think_is_refused(oai):
    tokenizer = shared().engine.tokenizer
    old, tokenizer.chat_template = tokenizer.chat_template, template_from_text("{{ messages[0].content }}", "plain")
    try:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=None, messages=ASK, max_tokens=4, extra_body={"max_reasoning_tokens": 3})
        assert e.value.body["param"] == "max_reasoning_tokens" and "thinking" in e.value.body["message"]
        r = oai.chat.completions.create(model=None, messages=ASK, max_tokens=4)  # no reasoning parser: plain content
        assert getattr(r.choices[0].message, "reasoning_content", None) is None
    finally:
        tokenizer.chat_template = old


def test_grpc_splits_the_thought_as_the_openai_front_does(oai, fronts):
    """gRPC: `reasoning_content` beside `text` (unary, and the stream's deltas joined) equal to the OpenAI front's
    message; `max_reasoning_tokens` and `chat_template_kwargs_json` reach the engine and the template, and bad
    values are INVALID_ARGUMENT naming the field."""
    sampling = dict(max_tokens=30, temperature=0.0, max_reasoning_tokens=6, ignore_eos=True)
    m = oai.chat.completions.create(
        model=None, messages=ASK, max_tokens=30, temperature=0.0,
        extra_body={"max_reasoning_tokens": 6, "ignore_eos": True},
    ).choices[0].message  # fmt: skip
    with Client(fronts[1].target) as client:
        request = build_request(chat_input(ASK), **sampling)
        whole = client.generate(request).completions[0]
        assert (whole.reasoning_content, whole.text) == (m.reasoning_content, m.content or "")
        assert len(whole.token_ids) == 30  # every token, the thought's too
        chunks = [r.chunk for r in client.generate_stream(request) if r.HasField("chunk")]
        assert "".join(c.reasoning_content for c in chunks) == whole.reasoning_content
        assert "".join(c.text for c in chunks) == whole.text
        off = client.generate(build_request(chat_input(ASK, chat_template_kwargs={"enable_thinking": False}),
                                            max_tokens=8, temperature=0.0)).completions[0]  # fmt: skip
        assert off.reasoning_content == "" and off.text
        plain = client.generate(build_request("Hi", max_tokens=8, temperature=0.0)).completions[0]
        assert plain.reasoning_content == ""  # a text prompt is not a chat: its text is left whole
        bad = build_request(chat_input(ASK), max_tokens=4)
        bad.chat.chat_template_kwargs_json = "[1]"
        with pytest.raises(grpc.RpcError) as e:
            client.generate(bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("chat.chat_template_kwargs_json: ")
        tokenizer = shared().engine.tokenizer
        old, tokenizer.chat_template = tokenizer.chat_template, template_from_text("{{ messages[0].content }}", "x")
        try:
            with pytest.raises(grpc.RpcError) as e:
                client.generate(build_request(chat_input(ASK), max_tokens=4, max_reasoning_tokens=3))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("sampling.max_reasoning_tokens: ")
        finally:
            tokenizer.chat_template = old
