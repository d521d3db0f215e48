"""`paged-jax run-batch`: an OpenAI batch file of chat, completions and embeddings lines answered through the HTTP
front's own app in process; bad lines answered alone (an error line, or the front's 400 body); a re-run skips what
is written and repairs a torn tail; bodies equal what a real HTTP server answers; kill -9 loses nothing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from paged_jax.config.pooling import read_pooler
from paged_jax.engine.load import load_model
from paged_jax.tokenization.chat_template import template_from_text
from serve.batch_file import run_file
from serve.config import ServingConfig
from serve.engine_loop import EngineLoop
from serve.openai_api.server import HttpServerThread

from support.engines import make_engine
from support.hf_golden import DATA
from support.serve_support import wait_until

MODEL = DATA / "hf_qwen3_embed"
ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = (  # Hermes tool calls (<tool_call> JSON </tool_call>), the tools kept short for the model's 256 tokens
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}{% endfor %}</tools>{% endif %}{# <tool_call> #}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
)
CONFIG = ServingConfig(port=0, http_port=0, served_model_names=("emb",))
CHAT = {"model": "emb", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 4}
COMPLETION = {"model": "emb", "prompt": [1, 5, 9, 14], "temperature": 0, "max_tokens": 4}
EMBEDDING = {"model": "emb", "input": [[1, 5, 9], [1, 7]], "encoding_format": "float"}
X = {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"], "additionalProperties": False}
TOOL = {"type": "function", "name": "f", "parameters": X}
TOOL_CHAT = {
    **CHAT,
    "max_tokens": 100,
    "tools": [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}],
    "tool_choice": {"type": "function", "function": {"name": "f"}},
}
RESPONSE = {"model": "emb", "input": "hi", "instructions": "Be brief.", "temperature": 0, "max_output_tokens": 4}
FORCE_F = {"type": "function", "name": "f"}
RESPONSE_CALL = {**RESPONSE, "max_output_tokens": 100, "tools": [TOOL], "tool_choice": FORCE_F}


def _line(cid, url, body, method="POST") -> str:
    return json.dumps({"custom_id": cid, "method": method, "url": url, "body": body})


GOOD = {
    "chat": ("/v1/chat/completions", CHAT),
    "completion": ("/v1/completions", COMPLETION),
    "embedding": ("/v1/embeddings", EMBEDDING),
    "tool-chat": ("/v1/chat/completions", TOOL_CHAT),
    "response": ("/v1/responses", RESPONSE),
    "response-call": ("/v1/responses", RESPONSE_CALL),
}
LINES = [
    _line("chat", *GOOD["chat"]),
    "{not json",
    _line("completion", *GOOD["completion"]),
    _line("bad-url", "/v1/images", {}),
    _line("bad-temperature", "/v1/completions", {**COMPLETION, "temperature": -1}),
    _line("embedding", *GOOD["embedding"]),
    _line("bad-dimensions", "/v1/embeddings", {**EMBEDDING, "dimensions": 999}),
    _line("completion", *GOOD["completion"]),  # a custom_id seen before
    _line("stream", "/v1/completions", {**COMPLETION, "stream": True}),
    _line("get", "/v1/completions", COMPLETION, method="GET"),
    _line("tool-chat", *GOOD["tool-chat"]),
    _line("response", *GOOD["response"]),
    _line("response-call", *GOOD["response-call"]),
    _line("bad-response", "/v1/responses", {**RESPONSE, "previous_response_id": "resp_unknown"}),
]


@pytest.fixture(scope="module")
def engine():
    config, params, tokenizer = load_model(MODEL, dtype="float32")
    tokenizer.chat_template = template_from_text(TEMPLATE)
    return make_engine(config, params, tokenizer, max_num_batched_tokens=32, pooler=read_pooler(MODEL))


def _run(engine, inp: Path, out: Path):
    return asyncio.run(run_file(engine, inp, out, CONFIG, progress=False))


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


VARIES = {"id", "call_id", "created", "created_at", "prompt_tokens_details", "input_tokens_details"}


def _strip(body):
    """A response body without what differs between two answers of one request (ids, timestamps, and the prompt
    tokens the prefix cache served, which the first answer left cached for the second)."""
    if isinstance(body, dict):
        return {k: _strip(v) for k, v in body.items() if k not in VARIES}
    return [_strip(v) for v in body] if isinstance(body, list) else body


def test_mixed_file_resume_and_equal_to_http(engine, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(LINES) + "\n")
    summary = _run(engine, inp, out)
    assert (summary.requests, summary.ok, summary.invalid_lines) == (9, 6, 5)
    lines = _read(out)
    assert len(lines) == 14
    by_cid = {(r["custom_id"], r["response"] is None): r for r in lines}
    for cid in GOOD:
        r = by_cid[cid, False]
        assert r["error"] is None and r["response"]["status_code"] == 200 and r["id"].startswith("batch_req_")
        assert r["response"]["request_id"] == r["response"]["body"]["id"]
    for cid, param in (("bad-temperature", "temperature"), ("bad-dimensions", "dimensions")):
        response = by_cid[cid, False]["response"]
        assert response["status_code"] == 400 and response["body"]["error"]["param"] == param
    response = by_cid["bad-response", False]["response"]
    assert response["status_code"] == 404 and response["body"]["error"]["param"] == "previous_response_id"
    call = by_cid["tool-chat", False]["response"]["body"]["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "f" and json.loads(call["arguments"])["x"] in (1, 2)  # forced: the schema holds
    items = by_cid["response-call", False]["response"]["body"]["output"]
    assert [(i["type"], i["name"]) for i in items] == [("function_call", "f")]
    assert by_cid["response", False]["response"]["body"]["object"] == "response"
    errors = {r["id"]: r for r in lines if r["response"] is None}
    assert sorted(errors) == [f"batch_req_line_{n}" for n in (10, 2, 4, 8, 9)]
    assert errors["batch_req_line_2"]["custom_id"] is None
    assert errors["batch_req_line_4"]["error"]["message"].startswith("line 4: url: ")
    assert "appears twice" in errors["batch_req_line_8"]["error"]["message"]
    assert errors["batch_req_line_9"]["error"]["message"].startswith("line 9: body.stream: ")
    assert errors["batch_req_line_10"]["error"]["message"].startswith("line 10: method: ")
    assert not engine.has_unfinished() and engine.kv.stats().pages_in_use == 0

    again = _run(engine, inp, out)  # everything written: nothing runs, nothing is added
    assert (again.requests, again.invalid_lines, again.skipped) == (0, 0, 14) and len(_read(out)) == 14

    # a run killed mid-write: two whole lines and a torn one; the re-run cuts it and answers the rest once
    whole = out.read_text().splitlines(keepends=True)
    out.write_text("".join(whole[:2]) + whole[2][:15])
    _run(engine, inp, out)
    final = _read(out)
    assert len(final) == 14 and len({(r["custom_id"], r["id"]) for r in final}) == 14
    assert {r["custom_id"] for r in final} == {r["custom_id"] for r in lines}

    # the same bodies POSTed to a real HTTP server on the same engine: the same responses
    loop = EngineLoop(engine).start()
    http = HttpServerThread(loop, CONFIG).start()
    try:
        for cid, (url, body) in GOOD.items():
            request = urllib.request.Request(
                http.base_url.removesuffix("/v1") + url, json.dumps(body).encode(), {"content-type": "application/json"}
            )
            with urllib.request.urlopen(request) as r:
                want = json.loads(r.read())
            got = _strip(by_cid[cid, False]["response"]["body"])
            want = _strip(want)
            # Embeddings: the second answer pools from the prefix cache (another step shape, another summation
            # order), so its floats match to float32 rounding; everything else is equal.
            for a, b in zip(got.get("data", ()), want.get("data", ()), strict=True):
                np.testing.assert_allclose(a.pop("embedding"), b.pop("embedding"), rtol=1e-5, atol=1e-6)
            assert got == want, cid
        request = urllib.request.Request(
            http.base_url + "/completions", json.dumps({**COMPLETION, "temperature": -1}).encode()
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request)
        assert json.loads(e.value.read()) == by_cid["bad-temperature", False]["response"]["body"]
    finally:
        http.stop()
        loop.stop()
    wait_until(lambda: engine.kv.stats().pages_in_use == 0, "every page back")


@pytest.mark.slow  # a fresh process (start-up and compiles)
def test_kill_9_loses_nothing(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"model": "emb", "temperature": 0, "max_tokens": 24, "ignore_eos": True}
    lines = [_line(f"r{i}", "/v1/completions", {**body, "prompt": [1, 3 + i % 50, 7]}) for i in range(40)]
    inp.write_text("\n".join(lines) + "\n")
    cmd = [
        sys.executable, "-m", "serve", "run-batch", "-i", str(inp), "-o", str(out), "--no-progress",
        "--model", str(MODEL), "--dtype", "float32", "--served-model-name", "emb", "--no-warmup",
        "--num-pages", "128", "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--attention-backend", "xla",
    ]  # fmt: skip
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = [json.loads(line)["custom_id"] for line in out.read_text().splitlines() if line.endswith("}")]
    assert 3 <= len(done) < 40
    rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr.decode()[-2000:]
    final = [r["custom_id"] for r in _read(out)]
    assert sorted(final) == sorted(f"r{i}" for i in range(40)) and len(final) == len(set(final))
    assert all(r["response"]["status_code"] == 200 for r in _read(out))
