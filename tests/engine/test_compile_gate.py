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
from paged_jax.worker.runner import EXECUTABLES
from paged_jax.worker.step_functions import GREEDY
from paged_jax.worker.step_inputs import SamplerFlags
from paged_jax.worker.warmup import WarmupProgress, serving_plans
from paged_jax.worker.warmup import jobs as warmup_jobs

from support.engines import make_engine as _make_engine

# num_pages unique to this module: its executables are not shared with other modules' engines.
make_engine = partial(_make_engine, num_pages=91, max_num_seqs=8, max_num_batched_tokens=64)
VICTIM = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
HOLD_S = 120  # a hang guard, not a timing assertion


def served_engine(tiny_config, tiny_params, **options):
    """An engine warmed as the server warms before it serves (decode buckets, common sampler variants)."""
    engine = make_engine(tiny_config, tiny_params, background_compiles=True, **options)
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


def solo(tiny_config, tiny_params, prompt: list[int], params: SamplingParams, **options):
    """The request alone on an engine that compiles on the step (the reference)."""
    engine = make_engine(tiny_config, tiny_params, **options)
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
    "hostile, options",
    [
        pytest.param(SamplingParams(max_tokens=4, temperature=0.0, logprobs=2), {}, id="sampler-variant"),
        pytest.param(SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1), {}, id="prompt-logprobs"),
        # n=12: 11 children copy more pages than the smallest copy bucket (the one in the first plan) takes
        pytest.param(SamplingParams(max_tokens=3, temperature=0.0, n=12), {"max_num_seqs": 16}, id="n-copies"),
        pytest.param(SamplingParams(max_tokens=3, temperature=0.0, repetition_penalty=1.3), {}, id="penalties"),
    ],
)
def test_a_request_waiting_for_its_compile_does_not_delay_the_steps_of_another(
    tiny_config, tiny_params, hostile, options
):
    engine = served_engine(tiny_config, tiny_params, **options)
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
        ref = solo(tiny_config, tiny_params, prompt, params, **options)
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


def test_a_cold_engine_runs_its_first_request_once_its_smallest_step_is_compiled(tiny_config, tiny_params):
    """Nothing compiled (a cold server): the first request waits for its own smallest step alone (three
    executables, compiled off the engine thread), never for a warm-up; the warm-up compiles those first too."""
    engine = make_engine(tiny_config, tiny_params, background_compiles=True, num_pages=89)  # its own shapes
    first, _ = serving_plans(engine.engine_config.max_num_seqs)
    head = [job.describe for job in warmup_jobs(engine.runner, first)[:5]]
    assert head[0] == "forward tokens=16 seqs=8" and head[-1] == "merge tokens=16"  # then the other buckets
    assert all(d.startswith("sample rows=8 ") for d in head[1:-1])
    held = Held()
    engine.compile_gate.worker.hold = held
    prompt, outputs = list(range(3, 9)), []
    engine.add_request("first", prompt, VICTIM)
    for _ in range(3):
        outputs += engine.step()
    assert outputs == [] and engine.waiting_for_compiles and engine.runner.compile_stats.count == 0
    held.release.set()
    run_until_done(engine, outputs)
    engine.compile_gate.worker.close(HOLD_S)
    assert sorted(held.jobs) == sorted([head[0], head[1], head[-1]])  # greedy: its own variant
    assert engine.runner.compile_stats.count == 3  # those three, and nothing on a step
    assert tokens(outputs, "first") == solo(tiny_config, tiny_params, prompt, VICTIM).outputs[0].token_ids


def test_an_n2_request_after_a_cold_engine_first_answer_waits_for_its_own_fork_shapes_only(tiny_config, tiny_params):
    """After a cold engine's first answer (its smallest step compiled, nothing else), an n=2 request waits for
    exactly what its fork step lacks at that bucket, its sampler variant of those rows and the smallest copy
    bucket (one page per child), compiled off the engine thread: not a forward at the largest fork sequence
    bucket, and nothing on a step."""
    engine = make_engine(tiny_config, tiny_params, background_compiles=True, num_pages=85, max_num_seqs=32)
    outputs: list = []
    engine.add_request("first", list(range(3, 9)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    run_until_done(engine, outputs)
    compiled = engine.runner.compile_stats.count
    held = Held()
    engine.compile_gate.worker.hold = held
    prompt, params = list(range(20, 31)), SamplingParams(max_tokens=4, temperature=0.8, n=2, seed=7, ignore_eos=True)
    engine.add_request("forks", prompt, params)
    for _ in range(3):
        outputs += engine.step()
    assert held.started.is_set() and "forks" in engine.compile_gate.deferred
    held.release.set()
    run_until_done(engine, outputs)
    engine.compile_gate.worker.close(HOLD_S)
    copy, sample = sorted(held.jobs)
    assert copy == engine.runner.jobs.copy(8).describe  # one child: the smallest copy bucket
    assert sample.startswith("sample rows=16 ") and sample.endswith(" do_sample")  # the first step's rows
    assert engine.runner.compile_stats.count == compiled + 2  # those two, and nothing on a step
    got = next(out for out in outputs if out.request_id == "forks" and out.finished)
    ref = solo(tiny_config, tiny_params, prompt, params)
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in ref.outputs]
    engine.check_invariants()
    assert engine.stats().pages_in_use == 0


class FirstAdvance(WarmupProgress):
    """Records, when the warm-up finishes its first shape, which keys the registry holds; then cancels it."""

    def __init__(self, keys, cancel: threading.Event) -> None:
        super().__init__()
        self.keys, self.cancel, self.seen = keys, cancel, None

    def advance(self):
        if self.seen is None:
            self.seen = [key in EXECUTABLES for key in self.keys]
            self.cancel.set()
        return super().advance()


def test_a_background_warm_up_compiles_what_waiting_requests_need_before_its_own_shapes(tiny_config, tiny_params):
    engine = served_engine(tiny_config, tiny_params, num_pages=87)  # no other test compiled its variants
    worker_thread_held, worker_thread_parked = threading.Event(), threading.Event()

    def hold(job) -> None:  # the compile worker's own thread waits: only the warm-up's threads can compile
        if threading.current_thread().name == "compile-worker":
            worker_thread_parked.set()
            assert worker_thread_held.wait(HOLD_S)

    engine.compile_gate.worker.hold = hold
    engine.add_request("a", list(range(3, 9)), SamplingParams(max_tokens=2, temperature=0.0, logprobs=1))
    engine.add_request("b", list(range(9, 19)), SamplingParams(max_tokens=2, temperature=0.0, repetition_penalty=1.2))
    engine.step()
    assert worker_thread_parked.wait(HOLD_S)  # it took its first job: the rest of the queue is the warm-up's to take
    queued = list(engine.compile_gate.worker._queue)
    assert len(queued) >= 2 and engine.compile_gate.deferred == {"a", "b"}
    cancel = threading.Event()
    tracker = FirstAdvance([job.key for job in queued], cancel)
    _, rest = serving_plans(engine.engine_config.max_num_seqs)
    engine.warmup(rest, progress=False, what="background warm-up", cancel=cancel, tracker=tracker)
    assert tracker.seen == [True] * len(queued)  # compiled by the warm-up's thread before its first own shape
    worker_thread_held.set()
    outputs: list = []
    run_until_done(engine, outputs)
    engine.compile_gate.worker.close(HOLD_S)
    assert {out.request_id for out in outputs if out.finished} == {"a", "b"}
    assert engine.stats().pages_in_use == 0


def test_a_draft_model_compile_does_not_delay_any_step(tiny_config, tiny_params):
    """The draft model's runner is gated too (`paged_jax.spec_decode.draft_gate`): while its step compiles on its
    own thread the victim gets a token every step without drafts, nothing compiles on the engine thread, and
    once compiled the drafts run; the tokens are the target's greedy tokens throughout."""
    spec = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3, "draft_num_pages": 37}  # own shapes
    engine = make_engine(tiny_config, tiny_params, background_compiles=True, speculative_config=spec)
    first, _ = serving_plans(engine.engine_config.max_num_seqs)
    engine.warmup(first, progress=False)
    draft = engine.spec.proposer
    held = Held()
    draft.compile_gate.worker.hold = held
    prompt, outputs = list(range(3, 13)), []
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("victim", prompt, params)
    outputs += engine.step()  # its prefill
    compiles = engine.runner.compile_stats.count, draft.runner.compile_stats.count
    before, steps = len(tokens(outputs, "victim")), 10
    for _ in range(steps):
        outputs += engine.step()
    assert held.started.is_set() and held.jobs[0].startswith("forward tokens=16")  # the draft's, off the loop
    assert len(tokens(outputs, "victim")) - before == steps  # one token a step: no drafts, no wait
    assert (engine.runner.compile_stats.count, draft.runner.compile_stats.count) == compiles
    assert engine.stats().spec_draft_tokens == 0
    held.release.set()
    draft.compile_gate.worker.wait(HOLD_S)
    while draft.compile_gate.worker.busy:
        draft.compile_gate.worker.wait(HOLD_S)
    run_until_done(engine, outputs)
    engine.stop_compiles(HOLD_S)
    assert engine.stats().spec_draft_tokens > 0  # drafts once the draft's step was compiled
    assert draft.runner.compile_stats.count == draft.compile_gate.worker.compiled  # all by its thread, none on a step
    want = solo(tiny_config, tiny_params, prompt, params).outputs[0].token_ids
    assert tokens(outputs, "victim") == want
    assert engine.stats().pages_in_use == 0 and draft.kv.stats().pages_in_use == 0
