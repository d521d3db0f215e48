"""POST /v1/embeddings through the official `openai` client against a real server on loopback: a small random
Qwen3-Embedding-shaped model (tests/data/hf_qwen3_embed) whose vectors match transformers' final hidden states
(last-token pooled, normalized; float and base64 alike; Matryoshka `dimensions`), a generative server that refuses
the route naming `model`, and bad input refused naming the parameter, every page back after each."""

from __future__ import annotations

import base64
import contextlib

import grpc
import numpy as np
import openai
import pytest

from paged_jax.config.pooling import read_pooler
from paged_jax.engine.load import load_model
from serve.client import Client
from serve.config import ServingConfig
from serve.engine_loop import EngineLoop
from serve.openai_api.server import HttpServerThread
from serve.server import ServerThread

from support.engines import make_engine
from support.hf_golden import DATA
from support.serve_support import LIMITS, wait_until

MODEL = DATA / "hf_qwen3_embed"
ATOL = 1e-4


@pytest.fixture(scope="module")
def golden():
    data = np.load(MODEL / "golden.npz")
    return [(data[f"prompt_{i}"].tolist(), data[f"hidden_{i}"]) for i in range(3)]


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL, dtype="float32")


@contextlib.contextmanager
def _serve(model, **options):
    engine = make_engine(*model, max_num_batched_tokens=16, **options)
    loop = EngineLoop(engine).start()
    config = ServingConfig(port=0, http_port=0, limits=LIMITS, served_model_names=("emb",))
    http = HttpServerThread(loop, config).start()
    rpc = ServerThread(loop, config).start()
    try:
        with openai.OpenAI(base_url=http.base_url, api_key="unused", max_retries=0) as client:
            client.grpc_target = rpc.target  # type: ignore[attr-defined]
            yield engine, client
    finally:
        rpc.stop()
        http.stop()
        loop.stop()


@pytest.fixture(scope="module")
def server(model):
    with _serve(model, pooler=read_pooler(MODEL)) as served:
        yield served


def _idle(engine) -> None:
    wait_until(lambda: not engine.has_unfinished() and engine.kv.stats().pages_in_use == 0, "every page back")
    engine.check_invariants()


def _unit(v):
    return v / np.linalg.norm(v)


def test_token_id_inputs_match_transformers_float_and_base64(server, golden):
    engine, client = server
    ids = [p for p, _ in golden]
    for fmt in (openai.omit, "float", "base64"):  # omitted: the client asks for base64 and decodes it
        out = client.embeddings.create(model="emb", input=ids, encoding_format=fmt)
        assert out.object == "list" and [d.index for d in out.data] == [0, 1, 2]
        assert out.usage.prompt_tokens == out.usage.total_tokens == sum(len(p) for p in ids)
        for d, (_, hidden) in zip(out.data, golden, strict=True):
            v = d.embedding
            v = np.frombuffer(base64.b64decode(v), "<f4") if isinstance(v, str) else v  # type: ignore[arg-type]
            np.testing.assert_allclose(v, _unit(hidden[-1]), atol=ATOL)
    _idle(engine)


def test_dimensions_truncate_then_renormalize_and_text_input(server, golden):
    engine, client = server
    out = client.embeddings.create(model="emb", input=golden[1][0], dimensions=8, encoding_format="float")
    np.testing.assert_allclose(out.data[0].embedding, _unit(golden[1][1][-1][:8]), atol=ATOL)
    texts = client.embeddings.create(model="emb", input=["hello", "hello world"], encoding_format="float")
    a, b = (np.asarray(d.embedding) for d in texts.data)
    assert a.shape == b.shape == (32,) and abs(np.linalg.norm(a) - 1) < 1e-5 and not np.allclose(a, b)
    _idle(engine)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1, -2]}, "input"),
        ({"input": [5] * 300}, "input"),  # longer than max_model_len (256)
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "dimensions": 33}, "dimensions"),
        ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "hi", "pooling": "cls"}, "pooling"),
    ],
)
def test_bad_input_is_400_naming_the_parameter(server, body, param):
    engine, client = server
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/embeddings", body={"model": "emb", **body}, cast_to=object)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    _idle(engine)


def test_grpc_embed_pools_as_the_http_route(server, golden):
    """The Embed RPC: the same vectors as /v1/embeddings (and as transformers), dimensions, usage; bad fields are
    INVALID_ARGUMENT naming them in the proto's words, and every page comes back."""
    engine, client = server
    ids = [p for p, _ in golden]
    with Client(client.grpc_target) as rpc:
        out = rpc.embed(["hello", *ids], request_id="e1")
        http = client.embeddings.create(model="emb", input="hello", encoding_format="float").data[0].embedding
        assert out.request_id == "e1" and len(out.embeddings) == 4
        assert out.usage.prompt_tokens == len(rpc.tokenize("hello")) + sum(len(p) for p in ids)
        np.testing.assert_allclose(out.embeddings[0].values, http, atol=1e-6)
        for e, (_, hidden) in zip(out.embeddings[1:], golden, strict=True):
            np.testing.assert_allclose(e.values, _unit(hidden[-1]), atol=ATOL)
        short = rpc.embed([ids[1]], dimensions=8).embeddings[0].values
        np.testing.assert_allclose(short, _unit(golden[1][1][-1][:8]), atol=ATOL)
        mean = rpc.embed([ids[1]], pooling="mean", normalize=False).embeddings[0].values
        http = client.post(
            "/embeddings", body={"model": "emb", "input": ids[1], "pooling": "mean", "normalize": False}, cast_to=object
        )["data"][0]["embedding"]
        np.testing.assert_allclose(mean, http, atol=1e-6)
        for inputs, fields, field in [
            ([], {}, "inputs: "),
            (["hi", [1, -2]], {}, "inputs[1].token_ids"),
            (["hi"], {"dimensions": 33}, "dimensions: "),
            (["hi"], {"pooling": "cls"}, "pooling: "),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                rpc.embed(inputs, **fields)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field)
    _idle(engine)


def test_generative_server_refuses_naming_model(model):
    with _serve(model) as (engine, client):  # the same weights without a pooler: generative only
        assert engine.engine_config.pooler is None
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="emb", input="hi")
        assert e.value.body["param"] == "model" and "--pooling" in e.value.body["message"]
        with Client(client.grpc_target) as rpc, pytest.raises(grpc.RpcError) as e:
            rpc.embed(["hi"])
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--pooling" in e.value.details()
        assert client.completions.create(model="emb", prompt="hi", max_tokens=2).usage.completion_tokens == 2
