"""Which step shapes does a run compile before its first step, and how?

A `WarmupPlan` names the shapes: every token bucket up to the most tokens one step of the run can hold (each
with its sequence bucket, see `paged_jax.worker.buckets`), the sampler variants its requests can combine (each
with the logit-bias columns, `paged_jax.worker.logit_bias`), the prompt-logprob step of each token bucket when
requests may ask for prompt logprobs, and the lookahead's merge. Compiling more than a run reaches is time the
user waits for nothing (on TPU tens of seconds a shape), so:

- the batch job knows every prompt and `max_tokens` before it starts (`plan_for_requests`);
- the Python API (`paged_jax.offline.llm.LLM`) compiles the forward step of every token bucket with its
  sequence bucket, the sampler variant of its default sampling parameters and the lookahead's merges
  (`first_use_plan`); the rest (other sampler variants, prompt logprobs, `n` > 1 copies and
  sequence buckets) compiles on first use, once per shape, with a progress bar while the step waits;
- the server compiles its decode buckets with the common sampler variants first (`serving_plans`), reports
  NOT_SERVING until they are ready, and compiles the rest in the background (a request that needs a shape the
  background has not reached compiles it at once: `paged_jax.worker.executables`);
- an engine built with `warmup=True` and no plan compiles everything (`WarmupPlan()`).

A plan that leaves shapes to their first use says so (`complete=False`): a compile after it is then logged as
info, not as the warning of a shape the warm-up missed.

`run_warmup` compiles a plan's shapes on a thread pool with a progress bar and logs what it cost: how many
executables the executable store served (no lowering), how many were compiled, and how many of those compiles
the persistent compilation cache served. Given a `WarmupProgress` it also counts each shape done there (the
server's `/health` and metrics read it) and logs the count at every tenth of the plan.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import jax
from tqdm.auto import tqdm

from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.buckets import bucket_for
from paged_jax.worker.compile_jobs import Job
from paged_jax.worker.executables import persistent_cache_summary
from paged_jax.worker.ready_shapes import request_flags
from paged_jax.worker.runner import ModelRunner
from paged_jax.worker.step_functions import GREEDY
from paged_jax.worker.step_inputs import SamplerFlags

log = logging.getLogger(__name__)

COMMON_SAMPLERS: tuple[SamplerFlags, ...] = (
    GREEDY,
    SamplerFlags(True, False, False, False),
    SamplerFlags(True, True, False, False),
)
ALL_SAMPLERS: tuple[SamplerFlags, ...] = tuple(
    SamplerFlags(s, f, p, lp) for s, f, _, _ in COMMON_SAMPLERS for p in (False, True) for lp in (False, True)
)


@dataclass(frozen=True, slots=True, kw_only=True)  # fields by name: a new one never shifts the others
class WarmupPlan:
    """The shapes to compile. `max_step_tokens`: the most tokens one step can hold (None: the token budget);
    every token bucket up to the one holding it is compiled, since a mixed step can have any size below."""

    max_step_tokens: int | None = None
    sampler_flags: tuple[SamplerFlags, ...] = ALL_SAMPLERS
    lookahead: bool = True  # the merge of the previous step's ids (async scheduling)
    copies: bool = True  # requests with n > 1: copy-on-write of pages, and their children's sample rows
    smallest_copy: bool = False  # without `copies`: the smallest page-copy bucket alone (a first n > 1 fork's)
    prompt_logprobs: bool = True  # the prompt-logprob step of every token bucket (requests with prompt_logprobs)
    pooling: bool = False  # the pooling step of every step shape (an engine that serves embeddings)
    complete: bool = True  # every shape the run can reach; False: the rest compile on first use, on purpose


@dataclass(slots=True)
class PhaseProgress:
    """One warm-up plan's shapes: how many it holds and how many are compiled (or loaded) so far."""

    planned: int = 0
    done: int = 0


@dataclass
class WarmupProgress:
    """How far a warm-up has got, by phase (`run_warmup`'s `what`: the server's "warm-up", which health waits
    for, then its "background warm-up"), in the order the phases ran. Written by the warm-up thread only;
    other threads read it (each read is of one int or one dict entry)."""

    phases: dict[str, PhaseProgress] = field(default_factory=dict)
    current: str | None = None  # the phase compiling now (None before the first and after the last)
    finished: bool = False  # every phase ran (or was cancelled)

    def start(self, what: str, planned: int) -> None:
        """A phase of `planned` shapes starts (a phase started again, as by each data-parallel replica, adds)."""
        self.phases.setdefault(what, PhaseProgress()).planned += planned
        self.current = what

    def advance(self) -> PhaseProgress:
        assert self.current is not None, "a shape done outside a phase"
        phase = self.phases[self.current]
        phase.done += 1
        return phase

    def finish(self) -> None:
        self.current, self.finished = None, True

    def describe(self) -> str:
        """One line: "warm-up 3/7, background warm-up 0/93 step shapes" (what /health says while warming up)."""
        parts = [f"{what} {p.done}/{p.planned}" for what, p in self.phases.items()]
        return (", ".join(parts) + " step shapes") if parts else "not started"

    def as_dict(self) -> dict:
        """JSON for /health: the phase compiling now ("done" once all ran) and each phase's counts."""
        phase = self.current or ("done" if self.finished else "not started")
        return {"phase": phase, **{what: {"done": p.done, "planned": p.planned} for what, p in self.phases.items()}}


def or_closure(flags: Iterable[SamplerFlags]) -> tuple[SamplerFlags, ...]:
    """Every variant a step can use: the element-wise OR of any non-empty subset of the requests' variants."""
    out = set(flags)
    while True:
        new = {SamplerFlags(*(a or b for a, b in zip(x, y, strict=True))) for x in out for y in out} - out
        if not new:
            return tuple(sorted(out))
        out |= new


def plan_for_requests(
    requests: Iterable[tuple[int, SamplingParams]], max_num_batched_tokens: int, lookahead: bool = True
) -> WarmupPlan:
    """The plan of a batch job: `requests` are (prompt tokens, params) of every request it will run.

    A step holds at most the token budget, and never more tokens than the requests have in all (prompts,
    plus outputs recomputed after a preemption)."""
    total, flags, copies, prompt = 0, set(), False, False
    for prompt_tokens, params in requests:
        total += params.n * (prompt_tokens + params.max_tokens)
        flags.add(request_flags(params))
        copies |= params.n > 1
        prompt |= params.prompt_logprobs is not None
    return WarmupPlan(
        max_step_tokens=min(total, max_num_batched_tokens),
        sampler_flags=or_closure(flags) if flags else (GREEDY,),
        lookahead=lookahead,
        copies=copies,
        prompt_logprobs=prompt,
    )


def first_use_plan(default_params: SamplingParams, lookahead: bool = True) -> WarmupPlan:
    """The Python API's plan: what a first `generate` with the default parameters needs (a prompt of any length
    up to the token budget, then decode), nothing else; every other shape compiles on its first use."""
    return WarmupPlan(
        max_step_tokens=None,
        sampler_flags=(request_flags(default_params),),
        lookahead=lookahead,
        copies=False,
        prompt_logprobs=False,
        complete=False,
    )


def serving_plans(max_num_seqs: int, lookahead: bool = True) -> tuple[WarmupPlan, WarmupPlan]:
    """The server's plans: decode steps (at most `max_num_seqs` tokens) with the common sampler variants and the
    smallest page copy (an n > 1 request forks one page per child), which it compiles before it reports SERVING;
    then everything, compiled in the background."""
    first = WarmupPlan(
        max_step_tokens=max_num_seqs,
        sampler_flags=COMMON_SAMPLERS,
        lookahead=lookahead,
        copies=False,
        smallest_copy=True,
        prompt_logprobs=False,
        complete=False,
    )
    return first, WarmupPlan(lookahead=lookahead)


def token_buckets(runner: ModelRunner, plan: WarmupPlan) -> list[int]:
    limit = min(plan.max_step_tokens or runner.token_buckets[-1], runner.token_buckets[-1])
    top = bucket_for(max(1, limit), runner.token_buckets)
    return [t for t in runner.token_buckets if t <= top]


def jobs(runner: ModelRunner, plan: WarmupPlan) -> list[Job]:
    """The plan's executables. First the smallest token bucket's whole step (its forward at its largest sequence
    bucket, the plan's sampler variants of those rows, the lookahead's merge, the smallest page copy): a request
    may run once these few are compiled (a cold server's first request waits for them alone, and an n > 1
    request's fork for no forward compile behind them: `paged_jax.engine.compile_gate`). Then the forward steps
    (the long compiles), sampling (with the penalties' history merge where a variant has penalties), prompt
    logprobs, pooling, the lookahead's merges, copies."""
    out = _all_jobs(runner, plan)
    t0 = token_buckets(runner, plan)[0]
    s0 = runner.step_seq_buckets(t0, forks=plan.copies)[-1]
    head = {runner.jobs.forward(t0, s0).key, runner.jobs.history(s0).key, runner.jobs.merge(t0).key}
    head |= {_sample(runner, s0, flags).key for flags in plan.sampler_flags}
    head.add(runner.jobs.copy(runner.copy_buckets[0]).key)
    return sorted(out, key=lambda job: job.key not in head)  # stable: each part keeps its order


def _sample(runner: ModelRunner, s: int, flags: SamplerFlags) -> Job:
    history = runner.history_len if flags.do_penalty else 1
    return runner.jobs.sample(s, runner.suppress_width, history, flags, runner.logit_bias_width)


def _all_jobs(runner: ModelRunner, plan: WarmupPlan) -> list[Job]:
    buckets = token_buckets(runner, plan)
    shapes = [(t, s) for t in buckets for s in runner.step_seq_buckets(t, forks=plan.copies)]
    out = [runner.jobs.forward(t, s) for t, s in shapes]
    for s in sorted({s for _, s in shapes}):
        out += [_sample(runner, s, flags) for flags in plan.sampler_flags]
        if any(flags.do_penalty for flags in plan.sampler_flags):  # penalties: the lookahead's history merge
            out.append(runner.jobs.history(s))
    if plan.prompt_logprobs:
        out += [runner.jobs.prompt_logprobs(t) for t in buckets]
    if plan.pooling:
        out += [runner.jobs.pool(t, s) for t, s in shapes]
    if plan.lookahead:
        out += [runner.jobs.merge(t) for t in buckets]
    copies = runner.copy_buckets if plan.copies else runner.copy_buckets[:1] if plan.smallest_copy else []
    out += [runner.jobs.copy(n) for n in copies]
    if runner.linear:  # a hybrid's state copies: forks, prefix-cache snapshots and their restores
        out += [runner.state_copy_job(n) for n in runner.copy_buckets]
    if runner.lora is not None:
        out.append(runner.jobs.lora_write())
    return out


def default_workers() -> int:
    """One compile thread per CPU this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_warmup(
    runner: ModelRunner,
    plan: WarmupPlan,
    progress: bool = True,
    workers: int | None = None,
    what: str = "warm-up",
    cancel: threading.Event | None = None,
    tracker: WarmupProgress | None = None,
    assist: Callable[[], None] | None = None,
) -> int:
    """Compile (or load) the plan's executables in parallel; returns how many were new to the process.
    Afterwards a compile a step needs (a shape no plan named) is logged: as a warning after a complete plan,
    as info after one that left shapes to their first use. `tracker`: counts the plan's shapes as `what`;
    `assist`: runs before each compile (what waiting requests need goes first, `CompileWorker.assist`)."""
    todo = jobs(runner, plan)
    if tracker is not None:
        tracker.start(what, len(todo))
    workers = workers or default_workers()
    stats = runner.compile_stats
    before = stats.count, stats.seconds, stats.cache_hits, stats.lower_seconds, stats.loaded, stats.load_seconds
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), desc=what, unit="shape", disable=not progress, leave=False)

    def one_done(_) -> None:
        bar.update(1)
        if tracker is not None:
            phase = tracker.advance()
            if phase.done * 10 // phase.planned > (phase.done - 1) * 10 // phase.planned:  # each tenth
                log.info("%s: %d/%d step shapes ready", what, phase.done, phase.planned)

    try:
        new = runner.compile(todo, workers, progress=one_done, cancel=cancel, assist=assist)
    finally:
        bar.close()
    runner.warm, runner.deferred = True, not plan.complete
    cache = persistent_cache_summary()
    cache_dir = jax.config.jax_compilation_cache_dir
    store = runner.store
    log.info(
        "%s: %d executables (forward for tokens %s) in %.1f s on %d threads: %d loaded from the executable "
        "store%s in %.1f s, %d compiled in %.1f s (%.1f s of it "
        "lowering), %d of those loaded from "
        "the persistent compile cache%s (process so far: %d hits, %d compiled by XLA, %d cache entries rejected)",
        what,
        new,
        token_buckets(runner, plan),
        time.perf_counter() - t0,
        workers,
        stats.loaded - before[4],
        f" ({store.directory}, {store.stats.rejected} entries rejected)" if store is not None else " (off)",
        stats.load_seconds - before[5],
        stats.count - before[0],
        stats.seconds - before[1],
        stats.lower_seconds - before[3],
        stats.cache_hits - before[2],
        f" ({cache_dir})" if cache_dir else " (off)",
        cache["hits"],
        cache["compiled"],
        cache["rejected"],
    )
    return new
