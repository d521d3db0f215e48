"""Structured output on the serving fronts (the tiny model, real servers on loopback): OpenAI's
`response_format`, vLLM's `structured_outputs` and `guided_*` extras through the official `openai` client, and
the gRPC `structured_output` message; bad constraints are 400 / INVALID_ARGUMENT naming the parameter (the
engine's `structured_outputs.<kind>` shown as the parameter that asked: `response_format.json`)."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest

from serve.client import Client
from serve.config import ServingConfig
from serve.openai_api.server import HttpServerThread
from serve.proto.paged_jax.v1 import generate_pb2 as pb

from support.serve_support import LIMITS, shared, start_server, wait_idle

SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
    "required": ["kind", "legs"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def fronts():
    grpc_front = start_server()
    http = HttpServerThread(shared().loop, ServingConfig(port=0, http_port=0, limits=LIMITS), shared().metrics).start()
    yield http, grpc_front
    http.stop()
    grpc_front.stop()


@pytest.fixture
def oai(fronts):
    with openai.OpenAI(base_url=fronts[0].base_url, api_key="unused", max_retries=0) as client:
        yield client
    wait_idle(Client(fronts[1].target))


@pytest.fixture
def grpc_client(fronts):
    with Client(fronts[1].target) as client:
        yield client
    wait_idle(Client(fronts[1].target))


def test_openai_response_format_json_schema_and_json_object(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    for seed in range(3):
        r = oai.completions.create(model=None, prompt="a pet: ", max_tokens=40, temperature=1.0, seed=seed,
                                   extra_body={"response_format": fmt})  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = oai.completions.create(model=None, prompt="{", max_tokens=60, temperature=0.0,
                               extra_body={"response_format": {"type": "json_object"}})  # fmt: skip
    assert r.choices[0].text.startswith("{")


def test_vllm_extras_regex_choice_grammar(oai):
    cases = [
        ({"structured_outputs": {"regex": r"[0-9]{2}:[0-9]{2}"}}, lambda t: re.fullmatch(r"[0-9]{2}:[0-9]{2}", t)),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ({"guided_regex": "(ab)+c"}, lambda t: re.fullmatch("(ab)+c", t)),
        ({"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, lambda t: re.fullmatch("x[0-9][0-9]", t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ]
    for extra, holds in cases:
        r = oai.completions.create(model=None, prompt="go: ", max_tokens=30, temperature=1.0, seed=7, extra_body=extra)
        assert holds(r.choices[0].text), (extra, r.choices[0].text)


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
            "response_format.json",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_json": "{not json"}, "guided_json.json"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
    ],
)
def test_bad_constraints_are_400_naming_the_parameter(oai, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=None, prompt="x", max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


def test_grpc_structured_output(grpc_client):
    so = pb.StructuredOutput(json_schema=json.dumps(SCHEMA))
    r = grpc_client.generate("pet: ", max_tokens=40, temperature=1.0, seed=3, structured_output=so)
    jsonschema.validate(json.loads(r.completions[0].text), SCHEMA)
    r = grpc_client.generate(
        "c: ", max_tokens=10, structured_output=pb.StructuredOutput(choice=pb.Choices(choices=["p", "q"]))
    )
    assert r.completions[0].text in ("p", "q")
    for so, field in [
        (pb.StructuredOutput(regex="a("), "sampling.structured_output.regex: "),
        (pb.StructuredOutput(json_schema="[1]"), "sampling.structured_output.json_schema: must be a JSON object"),
        (pb.StructuredOutput(json_object=False), "sampling.structured_output.json_object: must be true"),
        (pb.StructuredOutput(regex="a" * (64 * 1024 + 1)), "sampling.structured_output.regex: 65537 bytes"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            grpc_client.generate("x", max_tokens=4, structured_output=so)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(field), e.value.details()
