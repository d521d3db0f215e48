"""One validation path: the input processor checks a request the same way whichever front it came through.

Each invalid request below is written once in the engine's terms; the gRPC message, the OpenAI body and the
batch line built from it are refused by the same check, each front naming the field in its own words (its
table), and the engine's own `add_request` path (LLM) names it in the engine's.
"""

from __future__ import annotations

import json

import pytest

from paged_jax.engine.input_processor import ChatPrompt, GenerationRequest, InputLimits, InputProcessor
from paged_jax.errors import FieldError, FieldNames
from paged_jax.offline.lines import parse_line
from paged_jax.sampling_params import SamplingParams
from paged_jax.tokenization.chat_template import template_from_text
from paged_jax.tokenization.tokenizer import ByteTokenizer
from serve import convert
from serve.client import build_request, chat_input
from serve.config import ServingLimits
from serve.convert import GRPC_FIELDS, RequestError
from serve.openai_api.protocol import field_names, parse_body

MAX_MODEL_LEN = 64
LIMITS = ServingLimits(max_tokens=32, max_n=4, max_stop_strings=2, max_stop_string_chars=8)


def tokenizer() -> ByteTokenizer:
    tok = ByteTokenizer()
    tok.chat_template = template_from_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    return tok


def processor(limits: InputLimits | None = None, defaults: dict | None = None) -> InputProcessor:
    return InputProcessor(
        tokenizer(), vocab_size=320, max_model_len=MAX_MODEL_LEN, max_n=8, defaults=defaults, limits=limits
    )


def refused(fn) -> FieldError:
    with pytest.raises(FieldError) as e:
        fn()
    return e.value


# (what, prompt, sampling fields, the engine's field)
CASES = [
    ("empty text", "", {}, "prompt"),
    ("token id above the vocabulary", [5, 400], {}, "prompt_token_ids"),
    ("negative temperature", "hi", {"temperature": -1.0}, "temperature"),
    ("top_p 0", "hi", {"top_p": 0.0}, "top_p"),
    ("n 0", "hi", {"n": 0}, "n"),
    ("prompt + max_tokens past the model", [5] * 40, {"max_tokens": 30}, "max_tokens"),
    ("min_tokens above max_tokens", "hi", {"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ("bad role", ChatPrompt([{"role": "robot", "content": "x"}]), {}, "messages[0].role"),
]


@pytest.mark.parametrize("what,prompt,sampling,field", CASES, ids=[c[0] for c in CASES])
def test_the_engine_names_the_field(what, prompt, sampling, field):
    e = refused(lambda: processor().process(GenerationRequest(prompt, sampling)))
    assert e.field == field and str(e).startswith(f"{field}: "), str(e)


def _grpc(prompt, sampling):
    if isinstance(prompt, ChatPrompt):
        prompt = chat_input(list(prompt.messages))
    return build_request(prompt, **sampling)


@pytest.mark.parametrize("what,prompt,sampling,field", CASES, ids=[c[0] for c in CASES])
def test_grpc_names_the_same_field_in_its_words(what, prompt, sampling, field):
    with pytest.raises(RequestError) as e:
        convert.parse_generate(_grpc(prompt, sampling), processor(LIMITS.input_limits()))
    want = GRPC_FIELDS.front_name(field)
    assert e.value.message.startswith(f"{want}: ") and e.value.field == want, e.value.message


@pytest.mark.parametrize("what,prompt,sampling,field", CASES, ids=[c[0] for c in CASES])
def test_openai_names_the_same_field_in_its_words(what, prompt, sampling, field):
    kind = "chat" if isinstance(prompt, ChatPrompt) else "completion"
    body = {"messages": list(prompt.messages)} if kind == "chat" else {"prompt": prompt}
    req = parse_body(json.dumps({**body, **sampling}).encode(), kind)
    inputs = processor(LIMITS.input_limits())
    e = refused(lambda: [inputs.process(g) for g in req.generates])
    assert e.renamed(field_names(kind)).field == {"prompt_token_ids": "prompt"}.get(field, field)


@pytest.mark.parametrize("what,prompt,sampling,field", CASES, ids=[c[0] for c in CASES])
def test_a_batch_line_is_refused_by_the_same_check(what, prompt, sampling, field):
    line = {"messages": list(prompt.messages)} if isinstance(prompt, ChatPrompt) else {}
    if not line:
        line = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    try:  # sampling fields are checked when the line is read, the prompt when it is queued
        item = parse_line(json.dumps({"id": 1, **line, **sampling}), 1)
    except FieldError as e:
        assert e.field == field
        return
    e = refused(lambda: processor().process(GenerationRequest(item.prompt, item.params)))
    assert e.field == field


def test_field_names_come_from_the_table():
    assert GRPC_FIELDS.front_name("messages[1].content") == "chat.messages[1].content"
    assert GRPC_FIELDS.front_name("temperature") == "sampling.temperature"
    assert GRPC_FIELDS.front_name("prompt") == "text"
    assert field_names("chat", "max_completion_tokens").front_name("max_tokens") == "max_completion_tokens"
    assert field_names("chat").front_name("logprobs") == "top_logprobs"
    assert field_names("completion").front_name("logprobs") == "logprobs"
    assert FieldNames({"messages": "messages[2]"}).front_name("messages[0].role") == "messages[2][0].role"
    e = FieldError("messages[0].role", "must be one of ...").renamed(GRPC_FIELDS)
    assert (e.field, e.message, str(e)) == (
        "chat.messages[0].role",
        "must be one of ...",
        e.field + ": must be one of ...",
    )
    assert isinstance(e, ValueError)


def test_server_limits_and_defaults():
    inputs = processor(LIMITS.input_limits(), defaults={"temperature": 0.5, "max_tokens": 10})
    p = inputs.process(GenerationRequest("hi", {}))
    assert (p.params.temperature, p.params.max_tokens) == (0.5, 10)  # the model's defaults fill unset fields
    assert inputs.process(GenerationRequest("hi", {"temperature": 0.0})).params.temperature == 0.0
    long = inputs.process(GenerationRequest([5] * 60, {}))
    assert long.params.max_tokens == MAX_MODEL_LEN - 60  # a default never runs past the model's length
    assert refused(lambda: inputs.process(GenerationRequest("hi", {"max_tokens": 33}))).field == "max_tokens"
    assert refused(lambda: inputs.process(GenerationRequest("hi", {"n": 5}))).field == "n"  # the server's max_n
    assert refused(lambda: inputs.process(GenerationRequest("hi", {"stop": ["a", "b", "c"]}))).field == "stop"
    assert refused(lambda: inputs.process(GenerationRequest("hi", {"stop": ["s" * 9]}))).field == "stop"
    assert refused(lambda: inputs.process(GenerationRequest("x" * 600, {}))).field == "prompt"  # before encoding
    assert refused(lambda: inputs.process(GenerationRequest([5] * 64, {}))).field == "prompt_token_ids"
    assert refused(lambda: inputs.process(GenerationRequest("hi", {"colour": 1}))).field == "colour"
    assert refused(lambda: inputs.process(GenerationRequest("hi", {}, request_id=""))).field == "request_id"
    assert refused(lambda: inputs.process(GenerationRequest("hi", {}, cache_salt="s" * 300))).field == "cache_salt"


def test_without_server_limits_only_the_model_bounds_a_request():
    inputs = processor()
    p = inputs.process(GenerationRequest([5] * 40, SamplingParams(max_tokens=24, n=8, stop=["a", "b", "c"])))
    assert (len(p.prompt_token_ids), p.params.max_tokens, p.params.n) == (40, 24, 8)
    chat = inputs.process(GenerationRequest(ChatPrompt([{"role": "user", "content": "yo"}])))
    assert chat.prompt_token_ids == tokenizer().encode("user: yo\n", add_special_tokens=False)
    assert refused(lambda: inputs.process(GenerationRequest([5] * 40, SamplingParams(max_tokens=25)))).field == (
        "max_tokens"
    )
