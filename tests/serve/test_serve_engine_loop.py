"""The engine loop thread on its own (no gRPC): how it waits, and how aborts find their request."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from paged_jax.sampling_params import SamplingParams
from serve.convert import RequestError
from serve.engine_loop import EngineLoop, Submission

from support.serve_support import small_engine


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


def test_a_stale_abort_leaves_a_new_request_with_the_same_id_alone():
    """Issue 14.8: aborts were keyed by the client's request id, so the abort of an ended request (a client that
    stopped reading just as it finished) ended the next request reusing that id. They are keyed by stream."""
    loop = EngineLoop(small_engine()).start()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def until_final(stream):
        while True:
            event = await stream.get()
            assert event.code is None, event.message
            if event.output.finished:
                return event.output

    async def scenario():
        first = loop.submit("same-id", [5, 6, 7], params, None)
        await until_final(first)
        second = loop.submit("same-id", [5, 6, 7], params, None)
        loop.abort(first, "stale")  # queued after the second request's add
        out = await until_final(second)
        third = loop.submit("same-id", [5, 6, 7], SamplingParams(max_tokens=1000, ignore_eos=True), None)
        loop.abort(third, "live")  # the live request's own abort still ends it
        return out, await until_final(third)

    try:
        second, third = asyncio.run(scenario())
        assert second.outputs[0].finish_reason == "length" and len(second.outputs[0].token_ids) == 6
        assert third.outputs[0].finish_reason == "abort"
        assert loop.engine.kv.stats().pages_in_use == 0
    finally:
        loop.stop()


def test_multi_prompt_requests_hold_a_share_of_the_queue_and_one_admission_turn(monkeypatch):
    """Issue 25 item 6: requests of several prompts fill the queue only up to their share (8 slots, share 0.75: two
    3-prompt requests, a third is RESOURCE_EXHAUSTED), a one-prompt request still gets in, and the engine's
    waiting queue serves the groups in turns: the one-prompt request is third in line, not seventh. Nothing is
    admitted (max_num_seqs 0), so no slot frees and the order is exact."""
    engine = small_engine()
    monkeypatch.setattr(engine.scheduler, "max_num_seqs", 0)
    loop = EngineLoop(engine).start()
    params = SamplingParams(max_tokens=4)

    def group(name: str, k: int) -> list[Submission]:
        return [Submission(f"{name}-{i}", [5, 6, 7], params, None) for i in range(k)]

    async def scenario() -> list[str]:
        loop.submit_group(group("g1", 3), max_queued=8, max_queued_share=0.75)
        loop.submit_group(group("g2", 3), max_queued=8, max_queued_share=0.75)
        with pytest.raises(RequestError) as refused:
            loop.submit_group(group("g3", 3), max_queued=8, max_queued_share=0.75)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "6 for requests of several" in str(
            refused.value.message
        )
        loop.submit("single", [5, 6, 7], params, None, max_queued=8)
        return await loop.call(lambda e: [s.request_id for s in e.scheduler.waiting])

    try:
        order = asyncio.run(scenario())
        assert order == ["g1-0", "g2-0", "single", "g1-1", "g2-1", "g1-2", "g2-2"]
    finally:
        loop.stop()
    assert engine.kv.stats().pages_in_use == 0 and not engine.has_unfinished()
