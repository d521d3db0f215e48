"""Every invalid field gets INVALID_ARGUMENT naming it; garbage requests never crash or hang the server."""

from __future__ import annotations

import re
import threading

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve.client import Client, build_request
from serve.config import ServingLimits
from serve.proto.paged_jax.v1 import generate_pb2 as pb

from support.serve_support import ENGINE_CONFIG, LIMITS, PROMPTS, shared, start_server, wait_idle

FIELD_MESSAGE = re.compile(r"^[a-z_]+(\.[a-z_]+)?(\[\d+\])?: ")
GENERATE = "/paged_jax.v1.GenerationService/GenerateUnary"


@pytest.fixture(scope="module")
def server():
    srv = start_server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target) as c:
        yield c


def req(prompt="hi", **kwargs) -> pb.GenerateRequest:
    return build_request(prompt, **kwargs)


def empty_text() -> pb.GenerateRequest:
    r = pb.GenerateRequest()
    r.text = ""
    return r


def empty_ids() -> pb.GenerateRequest:
    r = pb.GenerateRequest()
    r.token_ids.SetInParent()
    return r


def bad_utf8(field_value: str, **kwargs) -> bytes:
    data = req(**kwargs).SerializeToString()
    assert data.count(field_value.encode()) == 1
    return data.replace(field_value.encode(), b"\xc3\x28" + b"z" * (len(field_value) - 2))


INVALID = [
    ("no input", pb.GenerateRequest(), "input"),
    ("empty text", empty_text(), "text"),
    ("empty token ids", empty_ids(), "token_ids"),
    ("token id above vocab", req([1, 5, 320]), "token_ids"),
    ("negative token id", req([1, -1]), "token_ids"),
    ("prompt longer than the model (ids)", req([5] * 2048), "token_ids"),
    ("prompt longer than the model (text)", req("x" * 3000), "text"),
    ("negative temperature", req(temperature=-0.5), "sampling.temperature"),
    ("NaN temperature", req(temperature=float("nan")), "sampling.temperature"),
    ("infinite temperature", req(temperature=float("inf")), "sampling.temperature"),
    ("top_p 0", req(top_p=0.0), "sampling.top_p"),
    ("top_p above 1", req(top_p=1.5), "sampling.top_p"),
    ("NaN top_p", req(top_p=float("nan")), "sampling.top_p"),
    ("top_k below -1", req(top_k=-2), "sampling.top_k"),
    ("min_p above 1", req(min_p=2.0), "sampling.min_p"),
    ("repetition penalty 0", req(repetition_penalty=0.0), "sampling.repetition_penalty"),
    ("presence penalty", req(presence_penalty=3.0), "sampling.presence_penalty"),
    ("n 0", req(n=0), "sampling.n"),
    ("n above the limit", req(n=LIMITS.max_n + 1), "sampling.n"),
    ("max_tokens above the limit", req(max_tokens=LIMITS.max_tokens + 1), "sampling.max_tokens"),
    ("prompt + max_tokens above the model", req([5] * 1000, max_tokens=1500), "sampling.max_tokens"),
    ("min_tokens above max_tokens", req(max_tokens=2, min_tokens=3), "sampling.min_tokens"),
    ("seed above 2^63", req(seed=2**63), "sampling.seed"),
    ("logprobs above 20", req(logprobs=21), "sampling.logprobs"),
    ("too many stop strings", req(stop=["a", "b", "c", "d", "e"]), "sampling.stop"),
    ("stop string too long", req(stop=["s" * 33]), "sampling.stop"),
    ("empty stop string", req(stop=[""]), "sampling.stop"),
    ("stop token id out of vocab", req(stop_token_ids=[400]), "sampling.stop_token_ids"),
    ("unknown output mode", req(output_mode=7), "output_mode"),
    ("empty request id", req(request_id=""), "request_id"),
    ("cache salt too long", req(cache_salt="s" * 300), "cache_salt"),
    ("invalid UTF-8 text", bad_utf8("hello there", prompt="hello there"), "text"),
    ("invalid UTF-8 stop string", bad_utf8("stopword", stop=["stopword"]), "sampling.stop[0]"),
    ("invalid UTF-8 request id", bad_utf8("my-request", request_id="my-request"), "request_id"),
    ("not a protobuf message", b"\x0a\xff\xff\xff\xff\x0f", "request"),
]


@pytest.mark.parametrize("what,request_,field", INVALID, ids=[w for w, _, _ in INVALID])
def test_invalid_argument_names_the_field(client, what, request_, field):
    raw = client.channel.unary_unary(
        GENERATE, request_serializer=None, response_deserializer=pb.GenerateUnaryResponse.FromString
    )
    stream = client.channel.unary_stream(
        GENERATE.replace("GenerateUnary", "Generate"),
        request_serializer=None,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    data = request_ if isinstance(request_, bytes) else request_.SerializeToString()
    for call in (lambda: raw(data, timeout=10), lambda: list(stream(data, timeout=10))):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, e.value.details())
        assert e.value.details().startswith(f"{field}:"), (what, e.value.details())


def test_other_rpcs_validate_and_server_still_serves(client):
    with pytest.raises(grpc.RpcError) as e:
        client.detokenize([1, 999])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("token_ids:")
    tok = client.channel.unary_unary(
        "/paged_jax.v1.GenerationService/Tokenize",
        request_serializer=None,
        response_deserializer=pb.TokenizeResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as e:
        tok(pb.TokenizeRequest(text="abcd").SerializeToString().replace(b"abcd", b"a\xffcd"), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("text:")
    with pytest.raises(grpc.RpcError) as e:  # beyond the message size limit: gRPC's own answer
        client.generate("x" * (LIMITS.max_message_bytes + 10), timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.generate(PROMPTS[0], temperature=0, max_tokens=3).completions[0].finish_reason
    wait_idle(client)


finite = st.floats(allow_nan=True, allow_infinity=True, width=64)
small_float = st.one_of(finite, st.floats(-3, 3))
sampling = st.fixed_dictionaries(
    {},
    optional={
        "temperature": small_float,
        "top_k": st.integers(-3, 400),
        "top_p": small_float,
        "min_p": small_float,
        "repetition_penalty": small_float,
        "presence_penalty": small_float,
        "frequency_penalty": small_float,
        "seed": st.integers(0, 2**64 - 1),
        "max_tokens": st.one_of(st.integers(0, 12), st.integers(0, 2**32 - 1)),
        "min_tokens": st.integers(0, 16),
        "stop": st.lists(st.text(max_size=40), max_size=6),
        "stop_token_ids": st.lists(st.integers(-(2**40), 2**40), max_size=5),
        "ignore_eos": st.booleans(),
        "n": st.integers(0, 12),
        "logprobs": st.integers(0, 25),
    },
)
prompts = st.one_of(
    st.text(max_size=60),
    st.lists(st.integers(-5, 330), max_size=40),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),
)
requests = st.builds(
    lambda prompt, s, rid, salt, mode: req(prompt, request_id=rid, cache_salt=salt, output_mode=mode, **s),
    prompts,
    sampling,
    st.one_of(st.none(), st.text(max_size=20)),
    st.one_of(st.none(), st.text(max_size=300)),
    st.integers(-2, 5),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    message=st.one_of(requests.map(lambda r: r.SerializeToString()), st.binary(max_size=200)), streaming=st.booleans()
)
def test_garbage_requests_get_an_answer(client, message, streaming):
    raw = (client.channel.unary_stream if streaming else client.channel.unary_unary)(
        GENERATE.replace("GenerateUnary", "Generate") if streaming else GENERATE,
        request_serializer=None,
        response_deserializer=bytes,
    )
    try:
        result = list(raw(message, timeout=30)) if streaming else raw(message, timeout=30)
        assert result
    except grpc.RpcError as e:
        assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS), e.details()
        assert FIELD_MESSAGE.match(e.details()), e.details()


def test_after_garbage_the_server_is_healthy_and_idle(client):
    assert client.health() == 1
    assert client.generate(PROMPTS[1], temperature=0, max_tokens=3).completions[0].token_ids
    wait_idle(client)


def test_n_above_max_num_seqs_is_rejected_and_model_info_says_so():
    """Issue 14.2: with a serving limit (16) above the engine's max_num_seqs (8), n=9 used to be accepted and
    wait for ever (all samples must run in one batch), blocking every request behind it."""
    srv = start_server(limits=ServingLimits())
    try:
        with Client(srv.target) as c:
            assert ServingLimits().max_n > ENGINE_CONFIG.max_num_seqs
            assert c.model_info().max_n == ENGINE_CONFIG.max_num_seqs
            for call in (
                lambda: c.generate("hi", n=9, max_tokens=2, timeout=10),
                lambda: list(c.generate_stream("hi", n=9, max_tokens=2, timeout=10)),
            ):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert e.value.details().startswith("sampling.n:"), e.value.details()
            assert len(c.generate("hi", n=8, max_tokens=2, timeout=60).completions) == 8
            wait_idle(c)
    finally:
        srv.stop()


def test_inputs_are_bounded_before_any_work(client):
    """Issue 14.3: Detokenize and Tokenize had no bound but the message size (4M ids took 2.95 s on the event
    loop), and Generate range-checked every id before looking at the prompt's length."""
    n = ENGINE_CONFIG.max_model_len + 1
    with pytest.raises(grpc.RpcError) as e:
        client.detokenize([5] * n)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("token_ids:") and "max_model_len" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        client.tokenize("x" * (8 * ENGINE_CONFIG.max_model_len + 1))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("text:")
    with pytest.raises(grpc.RpcError) as e:  # every id out of range, and too many: the length is named
        client.generate([10**6] * n, max_tokens=1)
    assert e.value.details().startswith("token_ids:") and "more than the limit" in e.value.details()
    assert client.detokenize([3 + ord("h"), 3 + ord("i")]) == "hi"


def test_tokenizer_work_runs_off_the_event_loop(client, monkeypatch):
    """Issue 14.3: tokenizing and detokenizing ran on the asyncio thread, stalling every stream and health check
    for as long as they took. They must run on a worker thread."""
    threads: list[str] = []
    tokenizer_cls = type(shared().engine.tokenizer)
    real_encode, real_decode = tokenizer_cls.encode, tokenizer_cls.decode

    def encode(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_encode(self, *args, **kwargs)

    def decode(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_decode(self, *args, **kwargs)

    monkeypatch.setattr(tokenizer_cls, "encode", encode)
    monkeypatch.setattr(tokenizer_cls, "decode", decode)
    assert client.tokenize("hi", add_special_tokens=False) == [3 + ord("h"), 3 + ord("i")]
    assert client.detokenize([3 + ord("h"), 3 + ord("i")]) == "hi"
    client.generate("hello", max_tokens=1, temperature=0)
    monkeypatch.undo()
    assert threads and "grpc-server" not in threads, threads
    assert any(name.startswith("serve-cpu") for name in threads)
