"""Shared pieces for the serve tests (no tests here): one engine and engine loop per session, offline
reference outputs computed on that engine before the loop takes it over, and small helpers."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

from paged_jax.config.engine import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.load import load_model
from paged_jax.outputs import RequestOutput
from paged_jax.sampling_params import SamplingParams
from serve.client import Client
from serve.config import ServingConfig, ServingLimits
from serve.engine_loop import EngineLoop
from serve.metrics import Metrics
from serve.server import ServerThread

from support.engines import make_engine

PROMPTS = ["Hello, my name is", "The capital of France is", "a", "Once upon a time, in a land far away, there"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
SAMPLED = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
# default_max_tokens 16 for chat too (a server's own default is the rest of the context): these tests' unset
# max_tokens stay short on the random tiny model.
LIMITS = ServingLimits(max_tokens=1800, default_max_tokens=16, max_n=8, max_stop_strings=4, max_stop_string_chars=32)
ENGINE_CONFIG = EngineConfig(
    num_pages=1024, max_num_seqs=8, max_num_batched_tokens=64, attention_backend="xla", max_model_len=2048
)


@dataclass
class Shared:
    engine: LLMEngine
    params: object  # the model weights (for a second engine)
    loop: EngineLoop
    metrics: Metrics
    greedy: dict[str, RequestOutput]  # offline outputs per prompt
    sampled: RequestOutput  # offline n=3 seeded output for PROMPTS[0]


def run_offline(engine: LLMEngine, prompt, params: SamplingParams, rid: str) -> RequestOutput:
    engine.add_request(rid, prompt, params)
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                last = out
    return last


@functools.cache
def shared() -> Shared:
    config, params, tokenizer = load_model("tiny")
    engine = LLMEngine(config, params, tokenizer, ENGINE_CONFIG)
    greedy = {p: run_offline(engine, p, GREEDY, f"ref-{i}") for i, p in enumerate(PROMPTS)}
    sampled = run_offline(engine, PROMPTS[0], SAMPLED, "ref-n")
    metrics = Metrics()
    loop = EngineLoop(engine, on_step=metrics.on_step).start()
    return Shared(engine, params, loop, metrics, greedy, sampled)


def small_engine(**options: Any) -> LLMEngine:
    """A second engine on the shared engine's model (its own pages, for its own loop): 200 pages, 8 sequences,
    16-token steps, the plain-XLA attention, no warm-up; `options` (EngineConfig fields) override them."""
    s = shared()
    options = {"num_pages": 200, "max_num_batched_tokens": 16} | options
    return make_engine(s.engine.config, s.params, s.engine.tokenizer, **options)


def start_server(**overrides) -> ServerThread:
    s = shared()
    config = ServingConfig(**({"port": 0, "limits": LIMITS, "allow_invariant_checks": True} | overrides))
    return ServerThread(s.loop, config, s.metrics).start()


def wait_until(condition, what: str, hang_after_s: float = 300.0) -> None:
    """Poll `condition()` until it holds. Tests wait on state, not on a time budget that a loaded machine could
    use up; `hang_after_s` only turns a real hang into a failure."""
    deadline = time.monotonic() + hang_after_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what} after {hang_after_s} s"
        time.sleep(0.01)


def stop_case(greedy: dict[str, RequestOutput], start: int = 3) -> tuple[str, RequestOutput, str]:
    """(prompt, its greedy output, a two-character stop string from that output at or after `start`) for the
    first prompt whose output has one without U+FFFD: the random `tiny` model often emits byte tokens that do
    not form UTF-8, and the detokenizer never emits a replacement character, so such a stop could never match."""
    for prompt, out in greedy.items():
        text = out.outputs[0].text
        for i in range(start, len(text) - 1):
            if "\ufffd" not in text[i : i + 2]:
                return prompt, out, text[i : i + 2]
    raise AssertionError(f"no greedy output has a two-character stop string without U+FFFD: {list(greedy.values())}")


def wait_idle(client: Client, timeout: float = 120.0):
    """Stats once no request is open and every page is free (fails the test otherwise; `timeout` is a hang
    guard: the pages of a cancelled request are freed before the next engine step)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats(check_invariants=True)
        if stats.num_open_requests == 0 and stats.pages_in_use == 0 and stats.num_running == 0:
            assert stats.invariants_ok, stats.invariants_error
            assert stats.pages_free == stats.pages_total
            return stats
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {stats}"
        time.sleep(0.01)
