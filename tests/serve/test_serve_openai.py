"""The OpenAI-compatible HTTP front, driven by the official `openai` client against real servers on loopback.

The main front shares the session's engine loop with a gRPC front (one engine, one KV cache): greedy output is
checked against the offline engine's, and pages and invariants through gRPC's GetStats. A second small engine
(one sequence at a time) shows the admission queue's 429 and a dead engine's 503.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
import urllib.error
import urllib.request

import openai
import pytest

from paged_jax.tokenization.chat_template import apply_chat_template
from serve.client import Client
from serve.config import ServingConfig
from serve.engine_loop import EngineLoop
from serve.openai_api.server import HttpServerThread

from support.serve_process import ServeProcess
from support.serve_support import (
    GREEDY,
    LIMITS,
    PROMPTS,
    SAMPLED,
    shared,
    small_engine,
    stop_case,
    wait_idle,
    wait_until,
)

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture
def stats(fronts):
    with Client(fronts[1].target) as client:
        yield client


def test_completions_greedy_match_offline_unary_and_streaming(oai):
    ref = shared().greedy
    for prompt in PROMPTS:
        want = ref[prompt].outputs[0]
        reason = "stop" if want.finish_reason == "eos" else want.finish_reason
        out = oai.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=GREEDY.max_tokens)
        assert out.object == "text_completion" and out.model == "tiny" and out.id.startswith("cmpl-")
        assert out.choices[0].text == want.text and out.choices[0].finish_reason == reason
        assert out.usage.prompt_tokens == len(ref[prompt].prompt_token_ids)
        assert out.usage.completion_tokens == len(want.token_ids)
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        chunks = list(
            oai.completions.create(
                model="tiny",
                prompt=prompt,
                temperature=0,
                stream=True,
                max_tokens=GREEDY.max_tokens,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
        assert all(c.usage is None for c in chunks[:-1])
        by_ids = oai.completions.create(
            model="tiny", prompt=ref[prompt].prompt_token_ids, temperature=0, max_tokens=GREEDY.max_tokens
        )
        assert by_ids.choices[0].text == want.text
        if len(ref[prompt].prompt_token_ids) > 16:  # a full page: the second request hits the prefix cache
            assert by_ids.usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_matches_grpc_chat_unary_and_streaming(oai, stats):
    want = stats.chat(CHAT, temperature=0, max_tokens=8, ignore_eos=True)
    out = oai.chat.completions.create(
        model="tiny", messages=CHAT, temperature=0, max_completion_tokens=8, extra_body={"ignore_eos": True}
    )
    c = out.choices[0]
    assert out.object == "chat.completion" and c.message.role == "assistant"
    assert c.message.content == want.completions[0].text and c.finish_reason == "length"
    assert (
        out.usage.prompt_tokens
        == want.usage.prompt_tokens
        == len(apply_chat_template(shared().engine.tokenizer, CHAT)[1])
    )
    chunks = list(
        oai.chat.completions.create(
            model="tiny", messages=CHAT, temperature=0, max_tokens=8, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        CHAT[1],
    ]
    assert (
        oai.chat.completions.create(
            model="tiny", messages=parts, temperature=0, max_tokens=8, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .message.content
        == c.message.content
    )


def test_n_seeded_sampling_reproducible_and_logprobs(oai):
    ref = shared().sampled
    kwargs = dict(
        model="tiny",
        prompt=PROMPTS[0],
        n=SAMPLED.n,
        temperature=SAMPLED.temperature,
        top_p=SAMPLED.top_p,
        seed=SAMPLED.seed,
        max_tokens=SAMPLED.max_tokens,
        extra_body={"ignore_eos": True},
    )
    first = oai.completions.create(**kwargs, logprobs=2)
    assert {c.index: c.text for c in first.choices} == {c.index: c.text for c in ref.outputs}
    assert first.usage.completion_tokens == SAMPLED.n * SAMPLED.max_tokens
    for c in first.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == SAMPLED.max_tokens
        assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    streamed: dict[int, str] = {}
    for chunk in oai.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in ref.outputs}
    chat = oai.chat.completions.create(
        model="tiny",
        messages=CHAT,
        temperature=0,
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content


def test_stop_strings_and_vllm_extras(oai):
    prompt, ref, stop = stop_case(shared().greedy)
    want = ref.outputs[0]
    out = oai.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=24, stop=[stop])
    c = out.choices[0]
    assert c.finish_reason == "stop" and want.text.startswith(c.text) and stop not in c.text
    assert c.model_extra["stop_reason"] == stop
    out = oai.completions.create(
        model="tiny",
        prompt=PROMPTS[0],
        temperature=0.7,
        max_tokens=6,
        user="u-1",
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=7,
        extra_body={
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 6,
            "ignore_eos": True,
            "skip_special_tokens": True,
            "cache_salt": "t1",
        },
    )
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"


def _status(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    return e.value


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(temperature="hot"), "temperature"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=5000), "max_tokens"),
        (dict(n=0), "n"),
        (dict(seed=-3), "seed"),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
        (dict(logprobs=21), "logprobs"),
        (dict(prompt=""), "prompt"),
        (dict(prompt=[["a"]]), "prompt"),
        (dict(extra_body={"top_k": -2}), "top_k"),
        (dict(suffix="!"), "suffix"),
    ],
)
def test_invalid_completion_fields_are_400_naming_the_param(oai, kwargs, param):
    args = dict(model="tiny", prompt="hi", max_tokens=2) | kwargs
    e = _status(lambda: oai.completions.create(**args))
    assert e.status_code == 400 and isinstance(e, openai.BadRequestError)
    assert e.body["param"] == param and e.body["type"] == "invalid_request_error", e.body
    assert e.body["message"].startswith(f"{param}: "), e.body


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role"),
        (dict(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
        (dict(messages=[]), "messages"),
        (dict(max_completion_tokens=5000), "max_completion_tokens"),
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(logprobs=True, top_logprobs=25), "top_logprobs"),
        (dict(response_format={"type": "xml"}), "response_format.type"),
    ],
)
def test_invalid_chat_fields_are_400_naming_the_param(oai, kwargs, param):
    args = dict(model="tiny", messages=CHAT, max_tokens=2) | kwargs
    e = _status(lambda: oai.chat.completions.create(**args))
    assert e.status_code == 400 and e.body["param"] == param, e.body


def test_unknown_model_is_404_and_models_health_metrics(oai, fronts):
    e = _status(lambda: oai.completions.create(model="gpt-4", prompt="hi", max_tokens=2))
    assert e.status_code == 404 and isinstance(e, openai.NotFoundError) and e.body["param"] == "model"
    assert [m.id for m in oai.models.list()] == ["tiny"]
    oai.completions.create(model="tiny", prompt="hi", max_tokens=1)
    root = fronts[0].base_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/health") as r:
        assert r.status == 200
    with urllib.request.urlopen(f"{root}/metrics") as r:
        text = r.read().decode()
    assert 'paged_jax_requests_total{method="OpenAI.Completions",status="OK"}' in text
    assert 'method="OpenAI.Completions",status="NOT_FOUND"' in text
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{root}/v1/nothing")
    assert e.value.code == 404 and "error" in json.loads(e.value.read())
    for method in ("GET", "HEAD", "OPTIONS", "PUT"):  # issue 25.2: 405 was mapped to UNIMPLEMENTED, then 500
        for route in ("/v1/completions", "/v1/chat/completions"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(urllib.request.Request(f"{root}{route}", method=method))
            assert e.value.code == 405 and "POST" in e.value.headers.get("allow", ""), (method, route)


def test_raw_sse_ends_with_done(fronts):
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": "a",
            "max_tokens": 3,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "logprobs": 0,
        }
    ).encode()
    request = urllib.request.Request(f"{fronts[0].base_url}/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.read().decode().split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert sum(len(json.loads(e[6:])["choices"][0]["logprobs"]["tokens"]) for e in events[:-1]) == 3


def _cancelled() -> float:
    return shared().metrics.requests.labels("OpenAI.Completions", "CANCELLED")._value.get()


def test_disconnect_mid_stream_frees_every_page(oai, stats):
    idle = wait_idle(stats)
    before, steps, cancelled = idle.pages_total, idle.num_steps, _cancelled()
    stream = oai.completions.create(
        model="tiny", prompt=PROMPTS[1], temperature=0, max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
    )
    seen = 0
    for chunk in stream:
        seen += len(chunk.choices[0].text)
        if seen >= 5:
            assert stats.stats().pages_in_use > 0
            break
    stream.close()
    after = wait_idle(stats)
    assert after.pages_free == before and _cancelled() == cancelled + 1
    assert after.num_steps - steps < 1500  # aborted, not run to its end


def test_unary_disconnect_aborts_and_frees(fronts, stats):
    steps, cancelled = wait_idle(stats).num_steps, _cancelled()
    with openai.OpenAI(base_url=fronts[0].base_url, api_key="unused", max_retries=0, timeout=0.5) as client:
        with pytest.raises(openai.APITimeoutError):
            client.completions.create(
                model="tiny", prompt=PROMPTS[2], temperature=0, max_tokens=1800, extra_body={"ignore_eos": True}
            )
    after = wait_idle(stats)
    assert after.pages_free == after.pages_total and _cancelled() == cancelled + 1
    assert after.num_steps - steps < 1800  # aborted when the client went away, not run to its end


def test_auth_and_draining(fronts):
    s = shared()
    http = HttpServerThread(
        s.loop, ServingConfig(port=0, http_port=0, auth_token="sesame", limits=LIMITS), s.metrics
    ).start()
    try:
        with openai.OpenAI(base_url=http.base_url, api_key="wrong", max_retries=0) as bad:
            e = _status(lambda: bad.completions.create(model="tiny", prompt="hi", max_tokens=2))
            assert e.status_code == 401 and isinstance(e, openai.AuthenticationError)
        with openai.OpenAI(base_url=http.base_url, api_key="sesame", max_retries=0) as good:
            assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
            with urllib.request.urlopen(http.base_url.removesuffix("/v1") + "/health") as r:
                assert r.status == 200  # health needs no token
            with urllib.request.urlopen(http.base_url.removesuffix("/v1") + "/metrics") as r:
                assert r.status == 200  # nor metrics, unless metrics_auth
            http.server.front.config = dataclasses.replace(http.server.front.config, metrics_auth=True)
            with pytest.raises(urllib.error.HTTPError) as he:
                urllib.request.urlopen(http.base_url.removesuffix("/v1") + "/metrics")
            assert he.value.code == 401
            metrics = urllib.request.Request(
                http.base_url.removesuffix("/v1") + "/metrics", headers={"Authorization": "Bearer sesame"}
            )
            with urllib.request.urlopen(metrics) as r:
                assert r.status == 200 and b"paged_jax_requests_total" in r.read()
            http.server.front.draining = True
            e = _status(lambda: good.completions.create(model="tiny", prompt="hi", max_tokens=2))
            assert e.status_code == 503 and isinstance(e, openai.InternalServerError)
            with pytest.raises(urllib.error.HTTPError) as he:
                urllib.request.urlopen(http.base_url.removesuffix("/v1") + "/health")
            assert he.value.code == 503
    finally:
        http.stop()


def test_queue_full_is_429_and_dead_engine_is_503(monkeypatch):
    """One sequence at a time, one waiting: a third request is refused 429; a dead engine loop answers 503."""
    engine = small_engine(max_num_seqs=1)
    loop = EngineLoop(engine).start()
    http = HttpServerThread(loop, ServingConfig(port=0, http_port=0, max_queued_requests=1, limits=LIMITS)).start()
    try:
        with openai.OpenAI(base_url=http.base_url, api_key="unused", max_retries=0) as client:
            long = dict(model="tiny", prompt="a", temperature=0, max_tokens=1500, extra_body={"ignore_eos": True})
            running = client.completions.create(**long, stream=True)
            next(iter(running))  # started: no longer queued
            waiting: list = []
            thread = threading.Thread(
                target=lambda: waiting.append(client.completions.create(model="tiny", prompt="b", max_tokens=2)),
                daemon=True,
            )
            thread.start()
            wait_until(lambda: loop.num_queued == 1, "the second request to wait in the queue")
            e = _status(lambda: client.completions.create(model="tiny", prompt="c", max_tokens=2))
            assert (
                e.status_code == 429 and isinstance(e, openai.RateLimitError) and e.body["code"] == "resource_exhausted"
            )
            running.close()  # frees the sequence: the waiting request runs
            thread.join(120)
            assert waiting and waiting[0].usage.completion_tokens >= 1
            real_step, fail = engine.step, threading.Event()

            def step():
                if fail.is_set():
                    raise RuntimeError("injected device failure")
                return real_step()

            monkeypatch.setattr(engine, "step", step)
            started = client.completions.create(**long, stream=True)
            chunks = iter(started)
            next(chunks)
            fail.set()  # the loop dies while this response streams: its last event is the error
            with pytest.raises(openai.APIError) as err:
                list(chunks)
            assert "injected device failure" in str(err.value)
            wait_until(lambda: not loop.alive, "the engine loop to die")
            e = _status(lambda: client.completions.create(model="tiny", prompt="c", max_tokens=2, stream=True))
            assert e.status_code == 503 and e.body["code"] == "unavailable"
            with pytest.raises(urllib.error.HTTPError) as he:
                urllib.request.urlopen(http.base_url.removesuffix("/v1") + "/health")
            assert he.value.code == 503
    finally:
        http.stop()
        loop.stop()


@pytest.mark.slow  # a fresh process (start-up and compiles)
def test_paged_jax_serve_port_sigterm_drains_both_fronts():
    """`python -m serve serve --port 0`: the HTTP front in the serving process; SIGTERM turns /health 503,
    refuses new work 503, ends an open stream with finish_reason `abort` after the grace period, exits 0."""
    with ServeProcess(
        *("--model", "tiny", "--grpc-port", "0", "--port", "0", "--num-pages", "300", "--max-num-seqs", "8"),
        *("--max-num-batched-tokens", "16", "--attention-backend", "xla", "--grace-period", "1"),
    ) as server:
        base_url = server.wait_for(r"OpenAI API on (http://\S+/v1)").group(1)
        server.drain()
        assert base_url.startswith("http://127.0.0.1:")  # loopback unless --host

        def health() -> int:
            try:
                with urllib.request.urlopen(base_url.removesuffix("/v1") + "/health") as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        wait_until(lambda: health() == 200, "/health 200 once the warm-up has compiled the decode shapes")
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            assert [m.id for m in client.models.list()] == ["tiny"]
            assert (
                client.completions.create(
                    model="tiny", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True}
                ).usage.completion_tokens
                == 3
            )
            long = client.completions.create(
                model="tiny", prompt="a", temperature=0, max_tokens=1800, stream=True, extra_body={"ignore_eos": True}
            )
            chunks = iter(long)
            next(chunks)
            server.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: health() == 503, "/health to turn 503 after SIGTERM")
            e = _status(lambda: client.completions.create(model="tiny", prompt="hi", max_tokens=2))
            assert e.status_code == 503
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert reasons == ["abort"]
        assert server.proc.wait(timeout=60) == 0


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]"])
def test_bodies_that_are_not_a_request_are_400(fronts, body):
    request = urllib.request.Request(f"{fronts[0].base_url}/completions", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request)
    error = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and error["param"] == "body" and error["type"] == "invalid_request_error", error


def _post(base_url: str, path: str, body=None, length: int | None = None) -> tuple[int, dict]:
    """POST with http.client: `length` declared and no body sent, or `body` (bytes, or an iterable of chunks sent
    with chunked framing); the status and the JSON error."""
    import http.client

    host, port = base_url.removeprefix("http://").split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        if length is not None:
            conn.putrequest("POST", f"/v1{path}")
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(length))
            conn.endheaders()  # and no body: the server must answer without it
        else:
            conn.request("POST", f"/v1{path}", body, {"Content-Type": "application/json"}, encode_chunked=True)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())["error"]
    finally:
        conn.close()


def test_a_body_past_the_limit_is_413_before_it_is_read_or_parsed(fronts):
    """`--max-body-bytes`: a declared length past it is answered 413 before any byte of the body arrives (the
    client sends none and waits: the answer cannot come from parsing); a chunked body is cut once it passes the
    limit; the limit is named. One byte more than the limit, as invalid JSON, is 413 too (never parsed)."""
    limit = LIMITS.max_body_bytes
    status, error = _post(fronts[0].base_url, "/completions", length=2**30)
    assert status == 413 and error["param"] == "body" and f"limit of {limit} bytes" in error["message"], error
    assert "--max-body-bytes" in error["message"] and error["type"] == "invalid_request_error"
    big = b"{" * (limit + 1)
    status, error = _post(fronts[0].base_url, "/chat/completions", big)
    assert status == 413 and error["param"] == "body", error
    chunks = iter([b"{" * 65536] * (limit // 65536 + 1))  # no Content-Length: chunked framing
    status, error = _post(fronts[0].base_url, "/completions", chunks)
    assert status == 413 and error["param"] == "body" and "Content-Length" not in error["message"], error
    request = urllib.request.Request(f"{fronts[0].base_url}/completions", big, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:  # urllib sends the whole body first: it still reads the 413
        urllib.request.urlopen(request)
    assert e.value.code == 413
    ok = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
    status = urllib.request.urlopen(urllib.request.Request(f"{fronts[0].base_url}/completions", ok)).status
    assert status == 200  # the server goes on


def test_tls_and_auth_shared_with_grpc(tmp_path):
    """The gRPC TLS certificate and bearer token protect the HTTP front too."""
    import ssl

    from tests.serve.test_serve import _self_signed

    cert, key, _ = _self_signed(tmp_path)
    s = shared()
    http = HttpServerThread(
        s.loop,
        ServingConfig(port=0, http_port=0, tls_cert_file=cert, tls_key_file=key, auth_token="tok", limits=LIMITS),
        s.metrics,
    ).start()
    try:
        base_url = http.base_url
        assert base_url.startswith("https://")
        trusted = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=cert))
        with openai.OpenAI(base_url=base_url, api_key="tok", max_retries=0, http_client=trusted) as client:
            assert [m.id for m in client.models.list()] == ["tiny"]
        plain_url = base_url.replace("https://", "http://")
        with openai.OpenAI(base_url=plain_url, api_key="tok", max_retries=0) as plaintext:
            with pytest.raises(openai.APIConnectionError):
                plaintext.models.list()
    finally:
        http.stop()


def test_a_failure_inside_the_front_is_500_for_that_request_alone(oai, stats, monkeypatch):
    """A bug while answering fails only its request: 500 (or a last error event) in OpenAI's shape with an error id,
    its pages freed; the next request is served."""
    from serve.openai_api.responses import ResponseBuilder

    def broken(self, *args):
        raise RuntimeError("injected formatting bug")

    steps = wait_idle(stats).num_steps
    monkeypatch.setattr(ResponseBuilder, "full", broken)
    e = _status(lambda: oai.completions.create(model="tiny", prompt="hi", max_tokens=2))
    assert e.status_code == 500 and "error id" not in e.body["message"] and "internal error (id" in e.body["message"]
    monkeypatch.setattr(ResponseBuilder, "delta_chunk", broken)
    stream = oai.completions.create(
        model="tiny", prompt="a", max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
    )
    with pytest.raises(openai.APIError) as err:
        list(stream)
    assert "internal error (id" in str(err.value)
    monkeypatch.undo()
    after = wait_idle(stats)
    assert after.pages_free == after.pages_total and after.num_steps - steps < 1500  # aborted, not run to its end
    assert oai.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_several_prompts_in_one_completions_request(oai):
    """A batch: prompt i is choice i (n=1), unary and streamed, each identical to its offline greedy output."""
    ref, prompts = shared().greedy, PROMPTS[:3]
    out = oai.completions.create(model="tiny", prompt=prompts, temperature=0, max_tokens=GREEDY.max_tokens)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [ref[p].outputs[0].text for p in prompts]
    assert out.usage.prompt_tokens == sum(len(ref[p].prompt_token_ids) for p in prompts)
    streamed: dict[int, str] = {}
    for chunk in oai.completions.create(
        model="tiny",
        prompt=prompts,
        temperature=0,
        max_tokens=GREEDY.max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    ):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {i: ref[p].outputs[0].text for i, p in enumerate(prompts)}
    two = oai.completions.create(
        model="tiny", prompt=[ref[prompts[0]].prompt_token_ids, prompts[1]], n=2, temperature=0, max_tokens=4
    )
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    e = _status(lambda: oai.completions.create(model="tiny", prompt=["fine", ""], max_tokens=2))
    assert e.status_code == 400 and e.body["param"] == "prompt"
