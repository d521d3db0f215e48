"""Whole-server lifecycle: an engine loop that dies, and SIGTERM draining a real `python -m serve` process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from test_serve_support import PROMPTS, shared

from paged_jax.engine import EngineConfig, LLMEngine
from serve.client import Client
from serve.config import ServingConfig
from serve.engine_loop import EngineLoop
from serve.proto.paged_jax.v1 import generate_pb2 as pb
from serve.server import ServerThread

ROOT = Path(__file__).resolve().parent.parent
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_engine_loop_death_ends_every_stream_unavailable(monkeypatch):
    s = shared()  # a second engine (this one dies) on the shared engine's weights
    engine = LLMEngine(s.engine.config, s.params, s.engine.tokenizer,
                       EngineConfig(num_pages=200, max_num_seqs=8, max_num_batched_tokens=16,
                                    attention_backend="xla", warmup=False))
    loop = EngineLoop(engine).start()
    server = ServerThread(loop, ServingConfig(port=0)).start()
    try:
        with Client(server.target) as client:
            calls = [client.generate_stream(PROMPTS[i], timeout=60, temperature=0, max_tokens=1500,
                                            ignore_eos=True) for i in range(3)]
            for c in calls:
                assert next(c).HasField("chunk")
            real_step = engine.step

            def failing_step():
                real_step()
                raise RuntimeError("injected device failure")

            monkeypatch.setattr(engine, "step", failing_step)
            start = time.monotonic()
            for c in calls:
                with pytest.raises(grpc.RpcError) as e:
                    list(c)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "injected device failure" in e.value.details()
            assert time.monotonic() - start < 5
            deadline = time.monotonic() + 5
            while client.health() != NOT_SERVING:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert client.health(pb.DESCRIPTOR.services_by_name["GenerationService"].full_name) == NOT_SERVING
            for call in (lambda: client.generate("x", max_tokens=2, timeout=5), lambda: client.stats(timeout=5)):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def _start_subprocess(grace: float) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve", "serve", "--model", "tiny", "--port", "0", "--num-pages", "300",
         "--max-num-seqs", "8", "--max-num-batched-tokens", "16", "--attention-backend", "xla",
         "--grace-period", str(grace)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if m := re.search(r"serving \S+ on (\S+:\d+)", line):
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
            with Client(m.group(1)) as client:  # NOT_SERVING until the warm-up's decode shapes are compiled
                while client.health() != SERVING:
                    assert time.monotonic() < deadline and proc.poll() is None
                    time.sleep(0.05)
            return proc, m.group(1)
    proc.kill()
    raise AssertionError("server did not start:\n" + "".join(lines[-30:]))


def test_sigterm_drains_then_aborts_and_exits_zero():
    proc, target = _start_subprocess(grace=2.0)
    try:
        with Client(target) as client:
            assert client.health() == SERVING
            short = client.generate_stream(PROMPTS[0], timeout=60, temperature=0, max_tokens=200, ignore_eos=True)
            long = client.generate_stream(PROMPTS[1], timeout=60, temperature=0, max_tokens=1800, ignore_eos=True)
            assert next(short).HasField("chunk") and next(long).HasField("chunk")
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while client.health() != NOT_SERVING:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as e:
                client.generate(PROMPTS[2], max_tokens=2, timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            short_final = [r for r in short if r.HasField("final")]
            assert [s.finish_reason for s in short_final[0].final.samples] == [pb.FINISH_REASON_LENGTH]
            long_final = [r for r in long if r.HasField("final")]
            assert [s.finish_reason for s in long_final[0].final.samples] == [pb.FINISH_REASON_ABORT]
            assert "shutting down" in long_final[0].final.message
            assert 0 < long_final[0].final.usage.completion_tokens < 1800
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_during_warmup_exits_zero():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PAGED_JAX_COMPILE_CACHE="off")
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve", "serve", "--model", "tiny", "--port", "0", "--num-pages", "300",
         "--max-num-seqs", "64", "--max-num-batched-tokens", "512", "--attention-backend", "xla"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # the engine logs its KV capacity just before warm-up starts
            if "KV cache:" in line:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
