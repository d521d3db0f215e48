"""A thought's budget and the answer's constraint (`paged_jax.structured.thought`): the matcher's forcing, and the
engine's replies on the tiny model: the end tag written at the budget, the answer continuing, a JSON schema
applied to the answer only, with and without the one-step lookahead."""

from __future__ import annotations

import json

import jsonschema
import pytest

from paged_jax.engine.input_processor import ChatPrompt
from paged_jax.errors import FieldError
from paged_jax.sampling_params import SamplingParams, StructuredOutputs
from paged_jax.structured.thought import ThoughtMatcher
from paged_jax.tokenization.chat_template import template_from_text
from paged_jax.tokenization.reasoning import FORMATS, Thought, split_reasoning
from paged_jax.tokenization.tokenizer import ByteTokenizer

from support.engines import make_engine

# DeepSeek-R1's way: the history's thoughts are cut at `</think>`, the generation prompt opens a new one.
OPEN = "{% for m in messages %}<u>{{ m.content.split('</think>')[-1] }}</u>{% endfor %}<a><think>\n"
THOUGHT = Thought(FORMATS["qwen3"], (1, 2), (3, 4, 5), "thinking")  # tags of 2 and 3 tokens
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}


def test_the_end_tag_is_forced_at_the_budget_and_finished_when_begun():
    m = ThoughtMatcher(THOUGHT, 3, None)
    for t in (7, 8):
        assert m.forced() is None and m.accept(t)
    assert m.needs_mask()  # the token on its way may be the last one the budget allows
    assert m.accept(9) and m.forced() == 3 and not m.accept(8) and "needs token 3" in m.error
    m = ThoughtMatcher(THOUGHT, 3, None)
    for t in (7, 8, 9, 3):  # the model began the tag as its budget ran out: only the rest is forced
        assert m.accept(t)
    assert m.forced() == 4 and m.accept(4) and m.forced() == 5 and m.accept(5)
    assert m.state == "answer" and m.forced() is None and not m.needs_mask()
    fork = ThoughtMatcher(THOUGHT, 1, None)
    fork.accept(7)
    copy = fork.fork()
    assert copy.forced() == 3 and copy.accept(3) and fork.forced() == 3  # independent states


def test_before_a_thought_an_inner_constraint_makes_the_model_open_it():
    before = Thought(THOUGHT.fmt, THOUGHT.start_ids, THOUGHT.end_ids, "before")
    assert ThoughtMatcher(before, None, None).forced() is None
    free = ThoughtMatcher(before, None, None)
    assert free.accept(9) and free.state == "answer"  # no thought opened: the reply is the answer
    m = ThoughtMatcher(before, None, ThoughtMatcher(THOUGHT, None, None))  # any matcher as the inner one
    assert m.forced() == 1 and m.accept(1) and m.forced() == 2 and m.accept(2) and m.state == "thinking"


@pytest.fixture
def engine_of(tiny_config, tiny_params):
    return lambda **options: make_engine(tiny_config, tiny_params, ByteTokenizer(), **options)


def _reply(engine, params: SamplingParams, rid: str = "r"):
    chat = ChatPrompt([{"role": "user", "content": "Hi"}], chat_template=template_from_text(OPEN))
    engine.add_request(rid, chat, params)
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return outs[rid]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_answer_continues_after_the_budget(engine_of, async_scheduling):
    engine = engine_of(async_scheduling=async_scheduling)
    end = ByteTokenizer().encode("</think>", add_special_tokens=False)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, max_reasoning_tokens=5)
    for c in _reply(engine, params).outputs:
        assert c.token_ids[5 : 5 + len(end)] == end and len(c.token_ids) == 24
        reasoning, content = split_reasoning(FORMATS["qwen3"], "thinking", c.text)
        assert content == ByteTokenizer().decode(c.token_ids[5 + len(end) :])
    zero = _reply(engine, SamplingParams(max_tokens=12, ignore_eos=True, max_reasoning_tokens=0), "z").outputs[0]
    assert zero.token_ids[: len(end)] == end


def test_a_schema_constrains_the_answer_only(engine_of):
    engine = engine_of()
    so = StructuredOutputs(json=SCHEMA)
    for budget in (4, None):
        params = SamplingParams(temperature=1.0, seed=5, max_tokens=200, structured_outputs=so)
        params.max_reasoning_tokens = budget if budget is not None else 12
        out = _reply(engine, params, f"s{budget}").outputs[0]
        reasoning, content = split_reasoning(FORMATS["qwen3"], "thinking", out.text)
        assert out.finish_reason == "eos" and reasoning is not None
        jsonschema.validate(json.loads(content), SCHEMA)


def test_a_budget_needs_a_thinking_template(engine_of):
    engine = engine_of()
    plain = ChatPrompt([{"role": "user", "content": "Hi"}], chat_template=template_from_text("{{ messages }}"))
    with pytest.raises(FieldError) as e:
        engine.add_request("p", plain, SamplingParams(max_reasoning_tokens=3))
    assert e.value.field == "max_reasoning_tokens" and "thinking" in e.value.message
    with pytest.raises(FieldError, match="^max_reasoning_tokens: must be an integer >= 0"):
        engine.add_request("q", "Hi", SamplingParams(max_reasoning_tokens=-1))
    assert not engine.has_unfinished()
