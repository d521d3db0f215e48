"""Quantized weights and KV through the other front doors: the batch job's command line and the gRPC server
answer with the same greedy tokens as the same quantized engine run offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paged_jax.config.engine import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.load import load_model
from paged_jax.sampling_params import SamplingParams
from serve.client import Client
from serve.config import ServingConfig
from serve.engine_loop import EngineLoop
from serve.metrics import Metrics
from serve.server import ServerThread

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Hello, my name is", "Once upon a time, in a land far away, there"]
OPTIONS = dict(
    num_pages=256,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    attention_backend="xla",
    max_model_len=512,
    kv_dtype="int8",
    warmup=False,
)


def offline(prompt: str, max_tokens: int) -> list[int]:
    config, params, tokenizer = load_model("tiny", quantization="int8")
    engine = LLMEngine(config, params, tokenizer, EngineConfig(**OPTIONS))
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                return out.outputs[0].token_ids
    raise AssertionError("no output")


@pytest.mark.slow  # a fresh process (start-up and compiles)
def test_batch_cli_with_quantization(tmp_path):
    lines = [
        json.dumps({"id": f"q{i}", "prompt": p, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
        for i, p in enumerate(PROMPTS)
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    cmd = [
        sys.executable,
        "-m",
        "paged_jax.offline.batch",
        "--model",
        "tiny",
        "--input",
        str(tmp_path / "in.jsonl"),
        "--output",
        str(tmp_path / "out.jsonl"),
        "--no-progress",
        "--no-warmup",
        "--num-pages",
        "256",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "64",
        "--attention-backend",
        "xla",
        "--max-model-len",
        "512",
        "--quantization",
        "int8",
        "--kv-dtype",
        "int8",
    ]
    res = subprocess.run(
        cmd, cwd=ROOT, env=os.environ | {"JAX_PLATFORMS": "cpu"}, capture_output=True, timeout=600, check=False
    )
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    out = {r["id"]: r["token_ids"] for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert out == {f"q{i}": offline(p, 8) for i, p in enumerate(PROMPTS)}


def test_grpc_with_quantization():
    config, params, tokenizer = load_model("tiny", quantization="int8")
    engine = LLMEngine(config, params, tokenizer, EngineConfig(**OPTIONS))
    metrics = Metrics()
    loop = EngineLoop(engine, on_step=metrics.on_step).start()
    server = ServerThread(loop, ServingConfig(port=0), metrics).start()
    try:
        with Client(server.target) as client:
            for prompt in PROMPTS:
                reply = client.generate(prompt, timeout=120, temperature=0.0, max_tokens=8, ignore_eos=True)
                assert list(reply.completions[0].token_ids) == offline(prompt, 8)
    finally:
        server.stop()
        loop.stop()
