"""LoRA adapters over HTTP: each served adapter is its own OpenAI model (listed by /v1/models with the base model
as `parent`), a request naming it runs with it (the tokens its offline run gives), an unknown model is a 404
naming it, and the runtime endpoints (on only with `enable_lora_runtime_updates`) load and unload adapters."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from serve.client import Client
from serve.config import ServingConfig
from serve.engine_loop import EngineLoop
from serve.openai_api.server import HttpServerThread
from serve.server import ServerThread

from support.lora_adapters import GREEDY, TINY, lora_engine, make_tiny_adapters, prompts, serve


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return make_tiny_adapters(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def loop(adapters):
    loop = EngineLoop(lora_engine())
    loop.adapters.add("a", adapters["all"].lora_path)
    loop.start()
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def http(loop):
    server = HttpServerThread(loop, ServingConfig(port=0, http_port=0, enable_lora_runtime_updates=True)).start()
    yield server
    server.stop()


def test_grpc_lora_name_runs_the_adapter_and_unknown_is_not_found(loop, adapters):
    p = prompts(1, seed=12)[0]
    want = serve(lora_engine(), [("a", p, GREEDY, adapters["all"])])
    server = ServerThread(loop, ServingConfig(port=0)).start()
    try:
        client = Client(server.target)
        got = client.generate(p, lora_name="a", max_tokens=10, temperature=0.0)
        assert list(got.completions[0].token_ids) == want["a"][0][0]
        with pytest.raises(grpc.RpcError) as err:
            client.generate(p, lora_name="nope", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'nope' is not served here" in err.value.details()
    finally:
        server.stop()


def post(http, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        http.base_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def complete(http, model: str, prompt: list[int]) -> tuple[int, dict]:
    return post(http, "/completions", {"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0.0})


def test_models_lists_each_adapter_with_its_base_as_parent(http, adapters):
    with urllib.request.urlopen(http.base_url + "/models", timeout=60) as r:
        data = json.loads(r.read())["data"]
    assert [(m["id"], m["parent"]) for m in data] == [(TINY.name, None), ("a", TINY.name)]
    assert data[1]["root"] == adapters["all"].lora_path


def test_a_request_naming_an_adapter_runs_with_it(http, adapters):
    p = prompts(1, seed=11)[0]
    want = serve(lora_engine(), [("a", p, GREEDY, adapters["all"]), ("base", p, GREEDY, None)])
    decode = lora_engine().tokenizer.decode
    code, body = complete(http, "a", p)
    assert code == 200 and body["model"] == "a"
    assert body["choices"][0]["text"] == decode(want["a"][0][0])
    code, body = complete(http, TINY.name, p)
    assert code == 200 and body["choices"][0]["text"] == decode(want["base"][0][0])


def test_an_unknown_model_is_a_404_naming_it(http):
    code, body = complete(http, "nope", [5, 6, 7])
    assert code == 404 and "'nope' is not served here" in body["error"]["message"]
    assert body["error"]["param"] == "model"


def test_runtime_load_and_unload(http, adapters, tmp_path):
    code, body = post(http, "/load_lora_adapter", {"lora_name": "qv", "lora_path": adapters["qv"].lora_path})
    assert code == 200, body
    assert complete(http, "qv", [5, 6, 7])[0] == 200
    code, body = post(http, "/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)})
    assert code == 400 and "no adapter_config.json" in body["error"]["message"]
    assert post(http, "/unload_lora_adapter", {"lora_name": "qv"})[0] == 200
    assert complete(http, "qv", [5, 6, 7])[0] == 404
    code, body = post(http, "/unload_lora_adapter", {"lora_name": "qv"})
    assert code == 404 and "'qv' is not served here" in body["error"]["message"]


def test_runtime_endpoints_are_off_unless_asked(adapters):
    loop = EngineLoop(lora_engine()).start()
    server = HttpServerThread(loop, ServingConfig(port=0, http_port=0)).start()
    try:
        code, _ = post(server, "/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["qv"].lora_path})
        assert code == 404
    finally:
        server.stop()
        loop.stop()
