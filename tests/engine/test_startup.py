"""Start-up: which shapes a run compiles, counting compiles, the persistent cache across processes, and the
server's health while it warms up."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.warmup import (
    GREEDY,
    PhaseProgress,
    WarmupPlan,
    WarmupProgress,
    jobs,
    or_closure,
    plan_for_requests,
    serving_plans,
    token_buckets,
)

from support.engines import make_engine as _make_engine
from support.engines import run_requests
from support.serve_process import ServeProcess

ROOT = Path(__file__).resolve().parents[2]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


make_engine = partial(_make_engine, max_num_batched_tokens=128)


def test_sampler_variants_are_the_or_closure_of_the_requests():
    greedy, hot, hot_lp = GREEDY, (True, True, False, False), (True, False, False, True)
    assert or_closure([greedy]) == (greedy,)
    assert set(or_closure([greedy, hot, hot_lp])) == {greedy, hot, hot_lp, (True, True, False, True)}


def test_batch_plan_holds_only_reachable_shapes(tiny_config, tiny_params):
    engine = make_engine(tiny_config, tiny_params)
    runner = engine.runner
    assert runner.token_buckets == [16, 32, 64, 128]
    small = plan_for_requests([(5, SamplingParams(max_tokens=4, temperature=0.0))] * 2, 128)
    assert small.max_step_tokens == 18 and small.sampler_flags == (GREEDY,) and not small.copies
    assert token_buckets(runner, small) == [16, 32]
    kinds = [job.key[0] for job in jobs(runner, small)]
    # seq bucket 8 for both: one sampler; the smallest bucket's whole step first
    assert kinds == ["forward", "sample", "merge", "forward", "merge"]
    big = plan_for_requests([(100, SamplingParams(max_tokens=50, temperature=0.7, top_p=0.9, n=2))], 128)
    assert token_buckets(runner, big) == runner.token_buckets and big.copies
    decode, rest = serving_plans(engine.engine_config.max_num_seqs)
    assert token_buckets(runner, decode) == [16] and token_buckets(runner, rest) == runner.token_buckets
    assert not decode.complete and rest.complete  # a request may need a shape before the background has it
    copies = [job.describe for job in jobs(runner, decode) if job.key[0] == "copy"]
    assert copies == [runner.jobs.copy(runner.copy_buckets[0]).describe]  # the smallest alone, for n > 1 forks


def test_a_served_engines_first_n2_request_compiles_nothing_its_first_plan_lacks(tiny_config, tiny_params):
    """An engine warmed with the server's first plan runs a first n=2 request (its fork copies one page per
    child) without a compile: the smallest page copy is in that plan, so the request never waits for a copy
    compiled beside the background warm-up; both samples equal the same request on a compile-on-step engine."""
    engine = make_engine(tiny_config, tiny_params, num_pages=81, background_compiles=True)  # its own shapes
    first, _ = serving_plans(engine.engine_config.max_num_seqs)
    engine.warmup(first, progress=False)
    compiled = engine.runner.compile_stats.count
    request = {"forks": (list(range(20, 31)), SamplingParams(max_tokens=4, temperature=0.8, n=2, seed=7))}
    got = run_requests(engine, request)["forks"]
    assert engine.runner.compile_stats.count == compiled and not engine.compile_gate.deferred
    want = run_requests(make_engine(tiny_config, tiny_params), request)["forks"]
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    assert engine.stats().pages_in_use == 0


def test_steady_state_compiles_nothing_and_a_missed_shape_is_a_warning(tiny_config, tiny_params, caplog):
    # num_pages unique to this test: its executables are not shared with other tests' engines.
    engine = make_engine(tiny_config, tiny_params, num_pages=77)
    plan = plan_for_requests([(40, SamplingParams(max_tokens=8, temperature=0.0))] * 4, 128)
    engine.warmup(plan, progress=False)
    stats = engine.stats()
    assert stats.compile_count == len(jobs(engine.runner, plan)) and stats.compiles_after_warmup == 0
    assert 0 < stats.compile_lower_seconds < stats.compile_seconds  # each executable timed: lowering, then XLA
    for i in range(4):
        engine.add_request(f"g{i}", list(range(3 + i, 43 + i)), SamplingParams(max_tokens=8, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().compile_count == stats.compile_count  # the plan held every shape the run used
    assert engine.stats().step_padding_tokens > 0 and engine.stats().step_tokens == 4 * 40 + 4 * 7
    with caplog.at_level(logging.WARNING, logger="paged_jax.worker.executables"):
        engine.add_request("hot", list(range(3, 20)), SamplingParams(max_tokens=2, temperature=0.9, logprobs=1))
        while engine.has_unfinished():
            engine.step()
    after = engine.stats()
    assert after.compiles_after_warmup >= 1 and after.compile_count > stats.compile_count
    assert any(
        "after warm-up: sample rows=8" in r.getMessage() and "want_logprobs" in r.getMessage() for r in caplog.records
    )


def _generate(tmp_path: Path, cache: Path, name: str) -> tuple[str, list[dict]]:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text(
        "".join(
            json.dumps({"id": i, "prompt": f"prompt number {i}", "max_tokens": 4, "temperature": 0.0}) + "\n"
            for i in range(3)
        )
    )
    out = tmp_path / f"{name}.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PAGED_JAX_COMPILE_CACHE=str(cache))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "serve",
            "generate",
            "--model",
            "tiny",
            "--input",
            str(inputs),
            "--output",
            str(out),
            "--num-pages",
            "64",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "32",
            "--no-progress",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted((json.loads(x) for x in out.read_text().splitlines()), key=lambda d: d["id"])
    return proc.stdout + proc.stderr, lines


_SO_FAR = r"process so far: (\d+) hits, (\d+) compiled by XLA, (\d+) cache entries rejected"


def _cache_counts(log: str) -> tuple[int, int]:
    """(hits, compiled by XLA) from the warm-up log line."""
    m = re.search(_SO_FAR, log)
    assert m, log[-3000:]
    return int(m.group(1)), int(m.group(2))


def _rejected(log: str) -> int:
    """Persistent-cache entries found but not loadable, from the warm-up log line."""
    m = re.search(_SO_FAR, log)
    assert m, log[-3000:]
    return int(m.group(3))


_LOADED = r"(\d+) executables loaded in [\d.]+ s, (\d+) compiled in"


def _loaded(log: str) -> tuple[int, int]:
    """(executables loaded from the executable store, executables compiled) from the summary's start-up line."""
    m = re.search(_LOADED, log)
    assert m, log[-3000:]
    return int(m.group(1)), int(m.group(2))


@pytest.mark.slow  # a fresh process (start-up and compiles)
def test_a_second_process_with_the_same_shapes_compiles_nothing(tmp_path):
    cache = tmp_path / "xla-cache"
    first_log, first = _generate(tmp_path, cache, "first")
    second_log, second = _generate(tmp_path, cache, "second")
    hits, compiled = _cache_counts(first_log)
    assert compiled > 0 and hits == 0
    loaded, step_compiles = _loaded(first_log)
    assert loaded == 0 and step_compiles > 0
    assert _loaded(second_log) == (step_compiles, 0)  # every step executable from the store, none lowered
    hits, compiled = _cache_counts(second_log)
    assert compiled == 0  # nothing else compiled either (the few other jits: JAX's persistent cache)
    assert [(d["id"], d["token_ids"]) for d in first] == [(d["id"], d["token_ids"]) for d in second]
    assert "start-up" in second_log and "0 after warm-up" in second_log
    assert re.search(r"0 compiled in 0.0 compile-s \(0.0 lowering", second_log)
    assert _rejected(second_log) == 0


@pytest.mark.slow  # two fresh processes (start-up and compiles)
def test_cache_entries_that_cannot_be_loaded_are_counted_and_logged(tmp_path):
    """An entry XLA refuses (as XLA:CPU does on some hosts) must not pass for an ordinary miss: corrupt ones
    take the same path (a warning, then a compile), in the executable store and in JAX's cache."""
    cache = tmp_path / "xla-cache"
    _, first = _generate(tmp_path, cache, "first")
    entries = [p for p in cache.iterdir() if p.name.endswith("-cache")]
    stored = list((cache / "executables").glob("*.exe"))
    assert entries and stored
    for p in entries + stored:
        p.write_bytes(b"not an executable")
    log, again = _generate(tmp_path, cache, "again")
    assert _rejected(log) > 0 and _cache_counts(log)[0] == 0
    assert "holds an entry XLA could not load" in log
    assert log.count("the executable store holds an entry that could not be loaded") == 1
    assert f"{len(stored)} entries rejected" in log and _loaded(log) == (0, len(stored))
    assert [d["token_ids"] for d in first] == [d["token_ids"] for d in again]


def _http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.slow  # a fresh process (start-up and compiles)
def test_server_is_not_serving_until_its_decode_shapes_are_compiled_and_shows_its_progress():
    """Health waits for the decode shapes; /health and /metrics say how far each warm-up phase has got; once
    the background warm-up is done, a request compiles nothing (every step shape was in a plan)."""
    from serve.client import Client

    with ServeProcess(
        *("tiny", "--grpc-port", "0", "--port", "0", "--num-pages", "100", "--max-num-seqs", "8"),
        *("--max-num-batched-tokens", "32", "--attention-backend", "xla"),
        env={"PAGED_JAX_COMPILE_CACHE": "off"},
    ) as server:
        target = server.wait_for(r"paged-jax serving \S+ on (\S+)").group(1)
        root = server.wait_for(r"paged-jax OpenAI API on (http://\S+)/v1").group(1)
        server.drain()
        proc = server.proc
        with Client(target) as client:
            # The warm-up thread starts after these lines: its first compile cannot be done yet.
            assert client.health() == NOT_SERVING
            status, body = _http(root + "/health")
            assert status == 503 and "warming up" in body
            deadline = time.monotonic() + 300  # a hang guard, not a timing assertion
            while client.health() != SERVING:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
            while (health := json.loads(_http(root + "/health")[1]))["warmup"]["phase"] != "done":
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
            first, rest = health["warmup"]["warm-up"], health["warmup"]["background warm-up"]
            assert first["done"] == first["planned"] > 0 and rest["done"] == rest["planned"] > first["planned"]
            assert health["compiling"] == {"requests_waiting": 0, "shapes_queued": 0}
            final = client.generate("hello", max_tokens=3, temperature=0.0)
            assert final.usage.completion_tokens == 3
            final = client.generate("hello", max_tokens=3, temperature=0.8, top_p=0.9, n=2)
        metrics = _http(root + "/metrics")[1]
        assert f'paged_jax_warmup_shapes_done{{phase="background warm-up"}} {float(rest["done"])}' in metrics
        assert "paged_jax_compiles_after_warmup_total 0.0" in metrics  # steady state: nothing left to compile
        assert "paged_jax_requests_waiting_for_compile 0.0" in metrics and "paged_jax_compiles_queued 0.0" in metrics
        # every executable compiled once: the background plan holds the first one's (store off: none loaded)
        assert f"paged_jax_compiles_total {float(rest['planned'])}" in metrics
        ready = f"background warm-up: {rest['planned']}/{rest['planned']} step shapes ready"
        assert any(ready in x for x in server.lines)
        assert server.sigterm() == 0


def test_warm_up_progress_is_counted_logged_and_exported(tiny_config, tiny_params, caplog):
    from serve.metrics import Metrics

    engine = make_engine(tiny_config, tiny_params, num_pages=83)
    plan = plan_for_requests([(20, SamplingParams(max_tokens=3, temperature=0.0))], 128)
    tracker, metrics = WarmupProgress(), Metrics()
    metrics.warmup_fn = lambda: tracker
    assert tracker.describe() == "not started" and tracker.as_dict() == {"phase": "not started"}
    with caplog.at_level(logging.INFO, logger="paged_jax.worker.warmup"):
        engine.warmup(plan, progress=False, tracker=tracker)
    n = len(jobs(engine.runner, plan))
    assert tracker.phases == {"warm-up": PhaseProgress(n, n)} and tracker.current == "warm-up"
    tracker.finish()
    assert tracker.as_dict() == {"phase": "done", "warm-up": {"done": n, "planned": n}}
    assert tracker.describe() == f"warm-up {n}/{n} step shapes"
    ticks = [r.getMessage() for r in caplog.records if "step shapes ready" in r.getMessage()]
    assert ticks[-1] == f"warm-up: {n}/{n} step shapes ready" and len(ticks) == min(n, 10)
    value = metrics.registry.get_sample_value
    assert value("paged_jax_warmup_shapes_done", {"phase": "warm-up"}) == n
    assert value("paged_jax_warmup_shapes_planned", {"phase": "warm-up"}) == n


@pytest.mark.parametrize("plan", [WarmupPlan(max_step_tokens=1), WarmupPlan(max_step_tokens=10_000)])
def test_plan_token_buckets_are_clamped_to_the_runner(tiny_config, tiny_params, plan):
    runner = make_engine(tiny_config, tiny_params).runner
    buckets = token_buckets(runner, plan)
    assert buckets[0] == 16 and buckets[-1] in (16, 128)


def test_cpu_kv_budget_defaults_to_4_gib_capped_by_memory_and_by_what_the_engine_can_hold():
    from paged_jax.worker.kv_budget import cpu_kv_budget

    gib = 2**30
    per_token = 46_080  # SmolLM2-135M in float32: 2 x 30 layers x 3 KV heads x 64 x 4 bytes
    big = cpu_kv_budget(None, per_token, 64, 8192, 16, available=64 * gib)
    assert big.bytes == 4 * gib and "default 4 GiB" in big.reason
    small_machine = cpu_kv_budget(None, per_token, 64, 8192, 16, available=6 * gib)
    assert small_machine.bytes == 3 * gib and "available" in small_machine.reason
    tiny_model = cpu_kv_budget(None, 2048, 32, 2048, 16, available=64 * gib)
    assert tiny_model.bytes == 2048 * 16 * (32 * 128 + 1) and "32 sequences of 2048" in tiny_model.reason
    asked = cpu_kv_budget(gib, per_token, 64, 8192, 16, available=64 * gib)
    assert asked.bytes == gib and "as requested" in asked.reason


def test_the_default_kv_cache_holds_max_num_seqs_sequences_of_max_model_len_and_the_flags_override_it():
    """The Python API's default engine on CPU gets exactly max_num_seqs x cdiv(max_model_len, page_size) pages
    plus the null page (the tiny model's 64 x 2048 tokens are far below 4 GiB), as `make run`'s flags get theirs."""
    from paged_jax.offline.llm import LLM

    def pages(**options) -> int:
        return LLM("tiny", warmup=False, **options).engine.num_pages

    assert pages() == 64 * (2048 // 16) + 1
    assert pages(max_num_seqs=8, max_model_len=500) == 8 * 32 + 1  # 500 tokens round up to 32 pages of 16
    assert pages(num_pages=100) == 100
    assert pages(cpu_kv_cache_bytes=2**20) == 2**20 // (16 * 2048)  # the tiny model's page: 16 x 2 KiB


def test_prometheus_mirrors_compile_counts_and_padding(tiny_config, tiny_params):
    from serve.metrics import Metrics

    engine = make_engine(tiny_config, tiny_params, num_pages=79)
    engine.warmup(plan_for_requests([(30, SamplingParams(max_tokens=3, temperature=0.0))], 128), progress=False)
    metrics = Metrics()
    engine.add_request("p", list(range(3, 33)), SamplingParams(max_tokens=3, temperature=0.0))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        metrics.on_step(engine)
        steps += 1
    stats = engine.stats()
    value = metrics.registry.get_sample_value
    assert value("paged_jax_compiles_total") == stats.compile_count > 0
    assert value("paged_jax_compile_seconds_total") == pytest.approx(stats.compile_seconds)
    assert value("paged_jax_compiles_after_warmup_total") == 0
    assert value("paged_jax_step_tokens_total") == stats.step_tokens == 30 + 2
    assert value("paged_jax_step_padding_tokens_total") == stats.step_padding_tokens == (32 - 30) + 2 * 15
    # one observation per step that launched work (the last call of a lookahead engine only collects)
    assert value("paged_jax_step_padding_ratio_count") == steps - 1
