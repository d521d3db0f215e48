"""The engine loop thread on its own (no gRPC): how it waits, and how aborts find their request."""

from __future__ import annotations

import asyncio
import time

from test_serve_support import shared

from paged_jax.engine import EngineConfig, LLMEngine
from paged_jax.sampling_params import SamplingParams
from serve.engine_loop import EngineLoop


def small_engine() -> LLMEngine:
    s = shared()
    return LLMEngine(s.engine.config, s.params, s.engine.tokenizer,
                     EngineConfig(num_pages=200, max_num_seqs=8, max_num_batched_tokens=16, attention_backend="xla",
                                  warmup=False))


def test_a_request_that_cannot_be_scheduled_does_not_spin_the_thread(monkeypatch):
    """Issue 14.2: with a request the scheduler cannot admit, every step is empty; the thread used to call
    `step` in a busy loop (100% CPU). It must wait for the next command instead."""
    engine = small_engine()
    monkeypatch.setattr(engine.scheduler, "max_num_seqs", 0)  # nothing can be admitted from now on
    calls = []
    real_step = engine.step

    def step():
        calls.append(1)
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    loop = EngineLoop(engine).start()
    try:
        async def submit():
            return loop.submit("stuck", [5, 6, 7], SamplingParams(max_tokens=4), None)

        asyncio.run(submit())
        while len(calls) < 2:  # it has tried, and found nothing to run
            time.sleep(0.01)
        before = len(calls)
        time.sleep(0.3)
        assert len(calls) - before <= 1, f"{len(calls) - before} empty steps in 0.3 s"
    finally:
        loop.stop()
