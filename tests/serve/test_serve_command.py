"""`paged-jax serve MODEL --port P` as a vLLM user runs it, in a real process: a Hugging Face id found in the local
hub cache, the official `openai` client with `--served-model-name` (two names) and `--api-key`, vLLM's `/version`,
`/ping` and `/health`, a chat reply that may run to the end of the context when max_tokens is unset, gRPC on
`--grpc-port` beside it, a quiet start-up, and SIGTERM ending it with status 0."""

from __future__ import annotations

import importlib.metadata
import json
import urllib.error
import urllib.request

import openai
import pytest
from grpc_health.v1 import health_pb2

from serve.client import Client

from support.serve_process import ServeProcess

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
MAX_MODEL_LEN = 48


def get(url: str, method: str = "GET") -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method)) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.slow  # a fresh process (start-up and the first request's compiles)
def test_serve_model_with_the_openai_client(hub_cache, tmp_path):
    hub_cache("acme/gqa-tiny")
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    with ServeProcess(
        *("acme/gqa-tiny", "--port", "0", "--grpc-port", "0"),
        *("--served-model-name", "gqa", "gqa-alias", "--api-key", "sesame", "--chat-template", str(template)),
        *("--max-model-len", str(MAX_MODEL_LEN), "--num-pages", "32", "--max-num-seqs", "2"),
        *("--max-num-batched-tokens", "16", "--attention-backend", "xla", "--no-warmup"),
        unset=("PAGED_JAX_API_KEY", "PAGED_JAX_AUTH_TOKEN", "VLLM_API_KEY"),
    ) as server:
        target = server.wait_for(r"paged-jax serving gqa on (\S+) \(gRPC\)").group(1)
        base_url = server.wait_for(r"paged-jax OpenAI API on (http://\S+/v1)").group(1)
        server.drain()
        root = base_url.removesuffix("/v1")

        assert any("fronts on the uvloop event loop" in line for line in server.lines)  # serve.event_loop
        assert get(root + "/version") == (200, {"version": importlib.metadata.version("paged-jax")})
        assert get(root + "/health") == (200, {"status": "ok"})  # no token needed (load balancers)
        assert get(root + "/ping") == get(root + "/ping", "POST") == (200, {"status": "ok"})

        with openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0) as intruder:
            with pytest.raises(openai.AuthenticationError):
                intruder.models.list()
        with openai.OpenAI(base_url=base_url, api_key="sesame", max_retries=0) as client:
            assert [m.id for m in client.models.list()] == ["gqa", "gqa-alias"]
            reply = client.chat.completions.create(
                model="gqa-alias",
                messages=[{"role": "user", "content": "Hi"}],
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert reply.model == "gqa"  # replies carry the first served name
            assert reply.choices[0].finish_reason == "length"
            assert reply.usage.prompt_tokens + reply.usage.completion_tokens == MAX_MODEL_LEN  # the rest of the context
            plain = client.completions.create(model="gqa", prompt="Hi", temperature=0, extra_body={"ignore_eos": True})
            assert plain.usage.completion_tokens == 16  # OpenAI's completions default, as vLLM
            with pytest.raises(openai.NotFoundError, match="'tiny' is not served here"):
                client.completions.create(model="tiny", prompt="Hi", max_tokens=1)
        with Client(target, token="sesame") as grpc_client:
            assert grpc_client.health() == health_pb2.HealthCheckResponse.SERVING
            assert grpc_client.generate("Hi", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
        assert server.sigterm() == 0
    log = "".join(server.lines)
    assert "random weights" not in log  # a real model: no warning
    assert "Unable to initialize backend" not in log  # JAX's platform probe stays quiet
    assert "Traceback" not in log
