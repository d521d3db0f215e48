"""No request waits behind another's compile (`EngineConfig.background_compiles`): while a shape one request
needs is compiling (held in flight by the compile thread's hook), the engine goes on stepping the others, in
compiled shapes, and compiles nothing itself; the held request then runs and every token equals the same request
run with its shapes compiled on the step (the old way)."""

from __future__ import annotations

import threading
from functools import partial

import pytest

from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.ready_shapes import StepNeeds, covers
from paged_jax.worker.step_functions import GREEDY
from paged_jax.worker.step_inputs import SamplerFlags
from paged_jax.worker.warmup import serving_plans

from support.engines import make_engine as _make_engine

# num_pages unique to this module: its executables are not shared with other modules' engines.
make_engine = partial(_make_engine, num_pages=91, max_num_seqs=8, max_num_batched_tokens=64)
VICTIM = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
HOLD_S = 120  # a hang guard, not a timing assertion


def served_engine(tiny_config, tiny_params):
    """An engine warmed as the server warms before it serves (decode buckets, common sampler variants)."""
    engine = make_engine(tiny_config, tiny_params, background_compiles=True)
    first, _ = serving_plans(engine.engine_config.max_num_seqs)
    engine.warmup(first, progress=False)
    return engine


class Held:
    """The compile thread's hook: every compile waits until `release` (or raises `error`), counted."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.started, self.release, self.error = threading.Event(), threading.Event(), error
        self.jobs: list[str] = []

    def __call__(self, job) -> None:
        self.jobs.append(job.describe)
        self.started.set()
        assert self.release.wait(HOLD_S)
        if self.error is not None:
            raise self.error


def tokens(outputs, rid: str) -> list[int]:
    """The tokens `rid`'s first sample got, over the steps that returned `outputs`."""
    return [t for out in outputs if out.request_id == rid for t in out.outputs[0].new_token_ids]


def flat(logprobs) -> tuple[list[int], list[float]]:
    """Token ids and logprob values of a list of `TokenLogprob | None` (ids compared exactly, values closely)."""
    ids, values = [], []
    for lp in logprobs:
        if lp is not None:
            ids += [lp.token_id, *(i for i, _ in lp.top)]
            values += [lp.logprob, *(v for _, v in lp.top)]
    return ids, values


def solo(tiny_config, tiny_params, prompt: list[int], params: SamplingParams):
    """The request alone on an engine that compiles on the step (the reference)."""
    engine = make_engine(tiny_config, tiny_params)
    engine.add_request("solo", prompt, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    return final


def run_until_done(engine, outputs: list) -> None:
    for _ in range(10_000):
        if not engine.has_unfinished():
            return
        outputs += engine.step()
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize(
    "hostile",
    [
        pytest.param(SamplingParams(max_tokens=4, temperature=0.0, logprobs=2), id="sampler-variant"),
        pytest.param(SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1), id="prompt-logprobs"),
        pytest.param(SamplingParams(max_tokens=3, temperature=0.0, n=3), id="n-copies"),
        pytest.param(SamplingParams(max_tokens=3, temperature=0.0, repetition_penalty=1.3), id="penalties"),
    ],
)
def test_a_request_waiting_for_its_compile_does_not_delay_the_steps_of_another(tiny_config, tiny_params, hostile):
    engine = served_engine(tiny_config, tiny_params)
    held = Held()
    engine.compile_gate.worker.hold = held
    victim_prompt, hostile_prompt = list(range(3, 9)), list(range(20, 31))
    outputs: list = []
    engine.add_request("victim", victim_prompt, VICTIM)
    for _ in range(3):
        outputs += engine.step()
    engine.add_request("hostile", hostile_prompt, hostile)
    compiles, before = engine.runner.compile_stats.count, len(tokens(outputs, "victim"))
    steps = 12
    for _ in range(steps):
        outputs += engine.step()
    assert held.started.is_set() and not held.release.is_set()  # its compile is in flight the whole time
    assert len(tokens(outputs, "victim")) - before == steps  # one token of the victim per engine step
    assert tokens(outputs, "hostile") == [] and "hostile" in engine.compile_gate.deferred
    assert engine.runner.compile_stats.count == compiles  # the engine thread compiled nothing
    assert engine.waiting_for_compiles and engine.stats().requests_waiting_for_compile == 1
    held.release.set()
    run_until_done(engine, outputs)
    engine.compile_gate.worker.close(HOLD_S)
    final = {out.request_id: out for out in outputs if out.finished}
    for rid, prompt, params in (("victim", victim_prompt, VICTIM), ("hostile", hostile_prompt, hostile)):
        ref = solo(tiny_config, tiny_params, prompt, params)
        got = final[rid]
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in ref.outputs], rid
        assert [o.finish_reason for o in got.outputs] == [o.finish_reason for o in ref.outputs], rid
        pairs = [(o.logprobs, r.logprobs) for o, r in zip(got.outputs, ref.outputs, strict=True) if params.logprobs]
        if params.prompt_logprobs:
            pairs.append((got.prompt_logprobs, ref.prompt_logprobs))
        for mine, theirs in pairs:
            (ids, values), (ref_ids, ref_values) = flat(mine), flat(theirs)
            assert ids == ref_ids and values == pytest.approx(ref_values, abs=1e-5), rid
    engine.check_invariants()
    assert engine.stats().pages_in_use == 0 and not engine.waiting_for_compiles


def test_a_prompt_longer_than_the_compiled_buckets_is_prefilled_in_compiled_chunks_beside_the_victim(
    tiny_config, tiny_params
):
    engine = served_engine(tiny_config, tiny_params)
    assert engine.compile_gate.shapes.cap(StepNeeds(), True) == 16  # the server's decode buckets only
    held = Held()
    engine.compile_gate.worker.hold = held
    long_prompt = list(range(40, 100))  # 60 tokens: its own bucket (64) is not compiled
    params = SamplingParams(max_tokens=4, temperature=0.0)
    outputs: list = []
    engine.add_request("victim", list(range(3, 9)), VICTIM)
    outputs += engine.step()
    engine.add_request("long", long_prompt, params)
    compiles, before, launched = engine.runner.compile_stats.count, len(tokens(outputs, "victim")), engine.num_launched
    for _ in range(8):
        outputs += engine.step()
    assert len(tokens(outputs, "victim")) - before == 8 and engine.num_launched - launched == 8
    assert engine.runner.compile_stats.count == compiles
    assert engine.runner.real_tokens <= 16 * engine.num_launched  # every step inside the compiled 16-token bucket
    assert held.started.is_set() and held.jobs[0].startswith("forward tokens=32")  # the next bucket, off the loop
    held.release.set()
    run_until_done(engine, outputs)
    engine.compile_gate.worker.close(HOLD_S)
    got = next(out for out in outputs if out.request_id == "long" and out.finished)
    assert got.outputs[0].token_ids == solo(tiny_config, tiny_params, long_prompt, params).outputs[0].token_ids
    assert engine.stats().pages_in_use == 0


def test_a_compile_that_fails_fails_only_the_request_that_needs_it(tiny_config, tiny_params):
    engine = served_engine(tiny_config, tiny_params)
    held = Held(error=RuntimeError("XLA refused the shape"))
    engine.compile_gate.worker.hold = held
    outputs: list = []
    engine.add_request("victim", list(range(3, 9)), VICTIM)
    outputs += engine.step()
    engine.add_request("hostile", list(range(20, 31)), SamplingParams(max_tokens=4, logprobs=2))
    outputs += engine.step()
    held.release.set()
    run_until_done(engine, outputs)
    failed = next(out for out in outputs if out.request_id == "hostile")
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert "compiling its step shapes failed: RuntimeError: XLA refused the shape" in failed.error
    assert len(tokens(outputs, "victim")) == VICTIM.max_tokens
    engine.check_invariants()
    assert engine.stats().pages_in_use == 0


def test_sampler_variants_cover_only_what_gives_the_same_tokens():
    sampled, filtered = SamplerFlags(True, False, False, False), SamplerFlags(True, True, False, False)
    logprobs = SamplerFlags(False, False, False, True)
    assert covers(sampled, GREEDY) and covers(filtered, sampled)
    assert covers(SamplerFlags(True, True, False, True), logprobs)
    assert not covers(GREEDY, sampled) and not covers(sampled, logprobs)
    assert not covers(SamplerFlags(False, False, True, False), GREEDY)  # penalties change the sampler's inputs
    needs = (
        StepNeeds()
        .with_request(SamplingParams(temperature=0.5))
        .with_request(SamplingParams(repetition_penalty=1.2, temperature=0.0, logprobs=1))
    )
    assert needs.variants == (sampled, SamplerFlags(True, False, True, True))
