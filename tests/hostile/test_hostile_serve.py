"""Hostile request bodies on both fronts (issue 25): every one is a 4xx / INVALID_ARGUMENT naming its field, never
an internal error, and the server goes on serving.

The HTTP and gRPC fronts share the session's engine loop; the tiny byte tokenizer gets a chat template that also
feeds a template variable `n` to `range()` (restored after the module).
"""

from __future__ import annotations

import gc
import json
import logging
import socket
import urllib.error
import urllib.request
import weakref

import grpc
import pytest

from paged_jax.bounded_json import MAX_DEPTH, load_json
from paged_jax.errors import FieldError
from paged_jax.tokenization.chat_template import template_from_text
from serve.client import Client, build_request, chat_input
from serve.config import ServingConfig
from serve.openai_api.server import HttpServerThread

from support.serve_support import LIMITS, shared, wait_idle, wait_until

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    "{% if n is defined %}{% for i in range(n) %}.{% endfor %}{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
USER = [{"role": "user", "content": "hi"}]
DIGITS = "7" * 5000  # more than int()'s 4,300-digit limit
DEEP = "[" * 100_000 + "]" * 100_000


def _post(base_url: str, route: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"{base_url}/{route}", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _chat(**extra) -> bytes:
    return json.dumps({"messages": USER, "max_tokens": 2} | extra).encode()


def _assistant_call(arguments: str) -> dict:
    """An assistant message of the history that called `f` with `arguments` (JSON text, as OpenAI sends it)."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _with(body: bytes, key: str, raw_value: str) -> bytes:
    """`body` (a JSON object) with `"key": raw_value` added as written (not re-encoded by json.dumps)."""
    return body[:-1] + f', "{key}": {raw_value}}}'.encode()


TOOL_WITH_DIGITS = '[{"type": "function", "function": {"name": "f", "parameters": {"maximum": ' + DIGITS + "}}}]"
# (route, body, the param the 400 names): each was an HTTP 500 (RecursionError, ValueError of int(), OverflowError
# of float(), UnicodeEncodeError) or is a template-variable misuse that must stay a 400
HOSTILE_HTTP = {
    "nested-100k": ("completions", _with(b'{"prompt": "a"}', "x", DEEP), "body"),
    "nested-65": ("completions", _with(b'{"prompt": "a"}', "x", "[" * 65 + "]" * 65), "x" + "[0]" * (MAX_DEPTH - 1)),
    "digits-max_tokens": ("completions", _with(b'{"prompt": "a"}', "max_tokens", DIGITS), "max_tokens"),
    "digits-in-tools": (
        "chat/completions",
        _with(_chat(), "tools", TOOL_WITH_DIGITS),
        "tools[0].function.parameters.maximum",
    ),
    "temperature-10**400": ("completions", _with(b'{"prompt": "a"}', "temperature", "1" + "0" * 400), "temperature"),
    "temperature-NaN": ("completions", _with(b'{"prompt": "a"}', "temperature", "NaN"), "temperature"),
    "surrogate-prompt": ("completions", b'{"prompt": "a\\ud800", "max_tokens": 2}', "prompt"),
    "surrogate-stop": ("completions", b'{"prompt": "a", "stop": ["x", "\\udfff"], "max_tokens": 2}', "stop[1]"),
    "surrogate-content": (
        "chat/completions",
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        "messages[0].content",
    ),
    "surrogate-role": ("chat/completions", b'{"messages": [{"role": "\\ud800", "content": "x"}]}', "messages[0].role"),
    "surrogate-name": (
        "chat/completions",
        b'{"messages": [{"role": "user", "content": "x", "name": "\\ud800"}]}',
        "messages[0].name",
    ),
    "surrogate-cache_salt": ("completions", b'{"prompt": "a", "cache_salt": "\\ud800"}', "cache_salt"),
    "surrogate-tools": (
        "chat/completions",
        _with(_chat(), "tools", '[{"type": "function", "function": {"name": "f\\ud800"}}]'),
        "tools[0].function.name",
    ),
    "surrogate-kwargs-key": (
        "chat/completions",
        _with(_chat(), "chat_template_kwargs", '{"a\\udc00": 1}'),
        "chat_template_kwargs",
    ),
    "high-surrogate-then-high": ("completions", b'{"prompt": "\\ud83d\\ud83d\\ude00"}', "prompt"),
    **{
        f"shadow-{name}": ("chat/completions", _chat(chat_template_kwargs={name: 1}), "chat_template_kwargs")
        for name in ("namespace", "range", "raise_exception", "strftime_now")
    },
    "range-too-big": ("chat/completions", _chat(chat_template_kwargs={"n": 10**12}), "chat_template_kwargs"),
    "range-not-int": ("chat/completions", _chat(chat_template_kwargs={"n": "many"}), "chat_template_kwargs"),
    "range-float": ("chat/completions", _chat(chat_template_kwargs={"n": 2.5}), "chat_template_kwargs"),
    # JSON inside string fields (issue 41): a RecursionError (HTTP 500) or Python's int() text as `param`
    "json-string-nested": (
        "chat/completions",
        _chat(structured_outputs={"json": "[" * 3000 + "]" * 3000}),
        "structured_outputs.json",
    ),
    "structural-tag-string-nested": (
        "completions",
        json.dumps({"prompt": "a", "structured_outputs": {"structural_tag": "{" * 3000}}).encode(),
        "structured_outputs.structural_tag",
    ),
    "tool-arguments-nested": (
        "chat/completions",
        _chat(messages=[*USER, _assistant_call("[" * 5000 + "]" * 5000)]),
        "messages[1].tool_calls[0].function.arguments",
    ),
    "tool-arguments-digits": (
        "chat/completions",
        _chat(messages=[*USER, _assistant_call('{"x": ' + DIGITS + "}")]),
        "messages[1].tool_calls[0].function.arguments.x",
    ),
    "regex-nested-repeats": (
        "completions",
        json.dumps({"prompt": "a", "structured_outputs": {"regex": "(a{700}){700}"}}).encode(),
        "structured_outputs.regex",
    ),
    "pattern-nested-repeats": (
        "chat/completions",
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a{1000}){1000}"}},
            }
        ),
        "response_format.json.pattern",
    ),
}


@pytest.mark.parametrize("case", HOSTILE_HTTP)
def test_hostile_http_bodies_are_400_naming_the_param(fronts, case):
    route, body, param = HOSTILE_HTTP[case]
    status, reply = _post(fronts[0].base_url, route, body)
    error = reply["error"]
    assert status == 400 and error["type"] == "invalid_request_error", reply
    assert error["param"] == param and error["message"].startswith(f"{param}: "), reply


def test_valid_unicode_and_64_bit_integers_still_pass(fronts):
    """The guard refuses nothing a real request holds: emoji as escaped surrogate pairs, brackets and escaped
    quotes inside strings, nesting at the limit, integers up to 2^64 - 1."""
    http = fronts[0]
    status, reply = _post(http.base_url, "completions", b'{"prompt": "\\ud83d\\ude00 [[{{\\"\\\\", "max_tokens": 2}')
    assert status == 200 and reply["usage"]["prompt_tokens"] > 0, reply
    nested = _with(b'{"prompt": "a", "max_tokens": 2}', "user", '"' + "[" * 100 + '"')
    assert _post(http.base_url, "completions", nested)[0] == 200
    status, reply = _post(http.base_url, "completions", _with(b'{"prompt": "a"}', "seed", str(2**64 - 1)))
    assert status == 400 and reply["error"]["param"] == "seed" and "2^63" in reply["error"]["message"], reply
    with Client(fronts[1].target) as client:
        wait_idle(client)


def _grpc_chat(client: Client, **fields) -> grpc.RpcError:
    chat = chat_input(USER)
    for name, value in fields.items():
        setattr(chat, name, value)
    with pytest.raises(grpc.RpcError) as e:
        client.generate(build_request(chat, max_tokens=2))
    return e.value


HOSTILE_GRPC = {
    "tools-digits": ({"tools_json": TOOL_WITH_DIGITS}, "chat.tools_json[0].function.parameters.maximum"),
    "tools-nested": ({"tools_json": DEEP}, "chat.tools_json"),
    "tools-surrogate": (
        {"tools_json": '[{"type": "function", "function": {"name": "\\ud800"}}]'},
        "chat.tools_json[0]",
    ),
    "kwargs-digits": ({"chat_template_kwargs_json": '{"n": ' + DIGITS + "}"}, "chat.chat_template_kwargs_json.n"),
    "kwargs-nested": ({"chat_template_kwargs_json": '{"n": ' + DEEP + "}"}, "chat.chat_template_kwargs_json"),
    "kwargs-surrogate": ({"chat_template_kwargs_json": '{"n": "\\ud800"}'}, "chat.chat_template_kwargs_json.n"),
    "kwargs-shadow": ({"chat_template_kwargs_json": '{"range": 1}'}, "chat.chat_template_kwargs_json"),
    "kwargs-range-float": ({"chat_template_kwargs_json": '{"n": 1e300}'}, "chat.chat_template_kwargs_json"),
    "tool_calls-digits": ({}, "chat.messages[0].tool_calls_json[0].function.arguments.x"),
}


@pytest.mark.parametrize("case", HOSTILE_GRPC)
def test_hostile_grpc_json_fields_are_invalid_argument(fronts, case):
    fields, where = HOSTILE_GRPC[case]
    with Client(fronts[1].target) as client:
        if case == "tool_calls-digits":
            chat = chat_input([{"role": "assistant", "content": ""}, *USER])
            call = '[{"type": "function", "function": {"name": "f", "arguments": {"x": ' + DIGITS + "}}}]"
            chat.messages[0].tool_calls_json = call
            with pytest.raises(grpc.RpcError) as e:
                client.generate(build_request(chat, max_tokens=2))
            error = e.value
        else:
            error = _grpc_chat(client, **fields)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert error.details().startswith(where), error.details()
        wait_idle(client)


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        ('{"a": "[[[", "b": [[1]]}', None, None),
        ('{"a": "\\\\", "b": "\\"]]]"}', None, None),
        ("[" * MAX_DEPTH + "]" * MAX_DEPTH, None, None),
        ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "[0]" * MAX_DEPTH, "nested deeper"),
        ('{"a": [1, {"b": Infinity}]}', "a[1].b", "Infinity is not a JSON number"),
        (f'{{"a": {-(2**64) + 1}}}', None, None),
        (f'{{"a": {2**64}}}', "a", "beyond the limit of 2^64"),
        ('{"a": ["\\ud800\\udc00", "\\udc00\\ud800"]}', "a[1]", "lone surrogate at character 0"),
        ('{"a": "\\\\ud800"}', None, None),  # an escaped backslash: the text \ud800, no surrogate
        ("{not json", "body", "not valid JSON"),
    ],
)
def test_load_json_bounds_and_names_the_place(text, field, message):
    if field is None:
        assert load_json(text.encode()) == json.loads(text)
        return
    with pytest.raises(FieldError) as e:
        load_json(text.encode())
    assert e.value.field == field and message in e.value.message
    with pytest.raises(FieldError) as e:  # below another field's name (gRPC's JSON string fields)
        load_json(text, "chat.tools_json")
    assert e.value.field == (
        "chat.tools_json" if field == "body" else f"chat.tools_json{'' if field[0] == '[' else '.'}{field}"
    )


# -- issue 25.4: conversations bounded before they are rendered and encoded -------------------------------------
def test_too_many_messages_are_refused_before_any_is_rendered(fronts, monkeypatch):
    import paged_jax.engine.input_processor as input_processor

    renders = []
    real = input_processor.chat_prompt_ids
    monkeypatch.setattr(input_processor, "chat_prompt_ids", lambda *a, **k: renders.append(1) or real(*a, **k))
    many = USER * (LIMITS.max_chat_messages + 1)
    status, reply = _post(fronts[0].base_url, "chat/completions", json.dumps({"messages": many}).encode())
    assert status == 400 and reply["error"]["param"] == "messages", reply
    assert f"{len(many)} messages, more than the limit of {LIMITS.max_chat_messages}" in reply["error"]["message"]
    with Client(fronts[1].target) as client, pytest.raises(grpc.RpcError) as e:
        client.chat(many, max_tokens=2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("chat.messages: ")
    assert renders == []


def test_a_long_render_is_refused_before_it_is_encoded(fronts, monkeypatch):
    """A template that writes far more than the prompt limit allows stops rendering at the limit's characters
    ((max_model_len - 1) x 8 here) and is never handed to the tokenizer."""
    tokenizer = shared().engine.tokenizer
    encoded: list[int] = []
    real = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **k: encoded.append(len(text)) or real(text, *a, **k))
    max_chars = (shared().engine.max_model_len - 1) * 8  # the server limit 0: the model's length less one
    status, reply = _post(fronts[0].base_url, "chat/completions", _chat(chat_template_kwargs={"n": max_chars + 1}))
    assert status == 400 and reply["error"]["param"] == "chat_template_kwargs", reply  # the kwarg made it long
    assert f"longer than {max_chars} characters" in reply["error"]["message"], reply
    assert all(n <= max_chars for n in encoded), encoded
    status, reply = _post(fronts[0].base_url, "chat/completions", _chat(chat_template_kwargs={"n": 100}))
    assert status == 200 and reply["usage"]["prompt_tokens"] > 100, reply


def test_input_processor_bounds_message_count_and_text_before_encoding():
    from paged_jax.engine.input_processor import ChatPrompt, GenerationRequest, InputLimits, InputProcessor

    engine = shared().engine
    inputs = InputProcessor(
        engine.tokenizer,
        vocab_size=engine.config.vocab_size,
        max_model_len=64,
        max_n=4,
        limits=InputLimits(max_chat_messages=3),
    )
    chat = ChatPrompt(USER * 4, template_kwargs={}, chat_template=template_from_text(TEMPLATE))
    with pytest.raises(FieldError, match="4 messages, more than the limit of 3") as e:
        inputs.process(GenerationRequest(chat))
    assert e.value.field == "messages"
    with pytest.raises(FieldError, match="prompt limit of 64 tokens") as e:  # no limit of its own: the model's
        inputs.process(GenerationRequest("x" * (64 * 8 + 1)))
    assert e.value.field == "prompt"


# -- issue 25.5: one request cannot ask for gigabytes of response ----------------------------------------------
def test_generated_tokens_and_logprob_entries_per_request_are_capped(fronts):
    http, grpc_front = fronts
    limits = LIMITS
    prompts = ["a"] * (limits.max_request_tokens // (limits.max_n * limits.max_tokens) + 1)
    body = {"prompt": prompts, "n": limits.max_n, "max_tokens": limits.max_tokens, "temperature": 1.0}
    status, reply = _post(http.base_url, "completions", json.dumps(body).encode())
    assert status == 400 and reply["error"]["param"] == "max_tokens", reply
    assert f"more than the limit of {limits.max_request_tokens} per request" in reply["error"]["message"]
    chat = {"messages": USER, "n": 8, "max_completion_tokens": 1000, "logprobs": True, "top_logprobs": 20}
    status, reply = _post(http.base_url, "chat/completions", json.dumps(chat).encode())
    assert status == 400 and reply["error"]["param"] == "top_logprobs", reply
    assert "168000 logprob entries" in reply["error"]["message"]
    assert str(limits.max_logprob_entries) in reply["error"]["message"]
    with Client(grpc_front.target) as client:
        with pytest.raises(grpc.RpcError) as e:
            client.generate("a", n=8, max_tokens=1000, logprobs=20, temperature=1.0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert e.value.details().startswith("sampling.logprobs: "), e.value.details()
        ok = client.generate("a", n=2, max_tokens=3, logprobs=2, temperature=1.0, ignore_eos=True)  # well below
        assert [len(c.logprobs) for c in ok.completions] == [3, 3]
        wait_idle(client)


def test_check_size_counts_prompt_logprobs():
    from paged_jax.engine.input_processor import InputLimits, InputProcessor, ProcessedRequest
    from paged_jax.sampling_params import SamplingParams

    engine = shared().engine
    inputs = InputProcessor(
        engine.tokenizer,
        vocab_size=engine.config.vocab_size,
        max_model_len=4096,
        max_n=8,
        limits=InputLimits(max_request_tokens=100, max_logprob_entries=1000),
    )

    def request(prompt_len: int, **sampling) -> ProcessedRequest:
        return ProcessedRequest(None, None, [1] * prompt_len, SamplingParams(**sampling), None)

    inputs.check_size([request(10, n=2, max_tokens=50)])  # 100 tokens: at the limit
    with pytest.raises(FieldError, match="101 tokens") as e:
        inputs.check_size([request(10, n=1, max_tokens=50), request(10, n=1, max_tokens=51)])
    assert e.value.field == "max_tokens"
    inputs.check_size([request(199, max_tokens=0, prompt_logprobs=4)])  # 995 entries
    with pytest.raises(FieldError, match="1005 logprob entries") as e:
        inputs.check_size([request(201, max_tokens=0, prompt_logprobs=4)])
    assert e.value.field == "prompt_logprobs"


# -- issue 25.7: a client that hangs up is not an ERROR in the log ----------------------------------------------
def _open_request(http, body: dict) -> socket.socket:
    """A raw connection that has sent one POST /v1/completions (so the test decides when it hangs up)."""
    host, port = http.server.config.host, http.server.port
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, port))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def test_disconnects_are_not_logged_as_errors(fronts, caplog):
    http, grpc_front = fronts
    long = {"prompt": "a", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    with Client(grpc_front.target) as client, caplog.at_level(logging.WARNING):
        wait_idle(client)
        for stream in (False, True):
            sock = _open_request(http, {**long, "stream": stream})
            if stream:
                assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # the stream has started
            else:
                wait_until(lambda: client.stats().pages_in_use > 0, "the unary request to run")
            sock.close()
            wait_idle(client)
        gc.collect()  # "exception was never retrieved" is logged when the forgotten future is collected
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [(r.name, r.getMessage()[:200]) for r in errors]


# -- issue 25.8: a stream whose client never reads is aborted, its pages and buffers freed ---------------------
def _never_reading(http, body: dict) -> socket.socket:
    """A raw connection with a small receive window that has sent one POST /v1/completions and will read nothing."""
    host, port = http.server.config.host, http.server.port
    payload = json.dumps(body).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window stays small
    sock.connect((host, port))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


# n=8 with logprobs: about 5 KB a step, 8.6 MB in all, far beyond the socket buffers (64 KiB send buffer, doubled)
UNREAD = {"prompt": "a", "max_tokens": 1800, "n": 8, "logprobs": 5, "ignore_eos": True, "stream": True}


def test_a_stream_never_read_is_aborted_and_everything_returns(fronts, caplog):
    """A client that opens a stream and never reads fills the socket buffers; then its request's unread events pile
    up in its inbox: past the backlog bound (8 events here, or 1 s without a read) the request is aborted and its
    pages freed. When the client goes, the handler ends and its buffered events are released (the inbox is
    collected). Waited for as state (no wall-clock claim about speed)."""
    _, grpc_front = fronts
    s = shared()
    config = ServingConfig(port=0, http_port=0, limits=LIMITS, max_stream_backlog=8, stream_stall_timeout_s=1.0)
    http = HttpServerThread(s.loop, config, s.metrics).start()
    try:
        with Client(grpc_front.target) as client, caplog.at_level(logging.INFO, "serve.engine_loop"):
            wait_idle(client)
            sock = _never_reading(http, UNREAD)
            wait_until(lambda: s.loop.num_open == 1, "the stream to start")
            with s.loop._lock:
                (stream,) = s.loop._streams.values()
            inbox = weakref.ref(stream.inbox)
            del stream
            wait_until(lambda: s.loop.num_open == 0, "the stalled stream to be aborted")
            (why,) = [r.getMessage() for r in caplog.records if "aborted: the client" in r.getMessage()]
            assert "events behind reading the stream (limit 8)" in why or "read nothing for 1 s" in why, why
            assert inbox().backlog <= 8 + 2  # the bound, the event past it, the abort's final event
            wait_idle(client)  # every page free, nothing running
            sock.close()

            def released() -> bool:
                gc.collect()
                return inbox() is None

            wait_until(released, "the handler to end and its buffered events to go")
    finally:
        http.stop()


def test_an_unread_http_connection_is_closed_by_the_kernel(fronts):
    """The connection of a client that reads nothing is closed (TCP_USER_TIMEOUT on the listener, 0.5 s here; the
    stall abort set far away), which ends its request: nothing stays open, every page is free."""
    _, grpc_front = fronts
    s = shared()
    config = ServingConfig(port=0, http_port=0, limits=LIMITS, stream_stall_timeout_s=600, http_send_timeout_s=0.5)
    http = HttpServerThread(s.loop, config, s.metrics).start()
    try:
        with Client(grpc_front.target) as client:
            wait_idle(client)
            sock = _never_reading(http, UNREAD)
            wait_until(lambda: s.loop.num_open == 1, "the stream to start")
            wait_until(lambda: s.loop.num_open == 0, "the connection to be closed and its request aborted")
            wait_idle(client)
            sock.settimeout(30)
            with pytest.raises(ConnectionResetError):  # the server's kernel reset it
                while sock.recv(65536):
                    pass
            sock.close()
    finally:
        http.stop()
