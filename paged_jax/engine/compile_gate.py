"""Which waiting requests may start this step, and how many tokens may it hold, so that no step compiles?

With `EngineConfig.background_compiles` (the server's setting) a request whose steps would need an executable
that is not compiled yet never holds up the others: the step's token budget is capped at the largest token
bucket whose executables the running requests have (a prompt longer than that is prefilled in chunks of it), a
waiting request whose own needs (a sampler variant, prompt logprobs, n > 1 copies, an adapter write;
`paged_jax.worker.ready_shapes.StepNeeds`) are not compiled at that bucket is not admitted (the requests behind it
are), and the missing executables are compiled on the runner's compile thread
(`paged_jax.worker.compile_worker`). Once they are there, the request is admitted like any other. The runner runs
each step in the smallest compiled shapes that hold it (`ModelRunner.resolve_shapes`).

Invariant: every running request's needs are compiled at the cap, so every step the scheduler can build from
them resolves to compiled shapes; a request entered the running set only through the gate. The gate holds from
the engine's start, before any warm-up: while nothing is compiled, a request waits for its own step's
executables at the smallest token bucket (compiled ahead of the rest: a cold server's first request runs as soon
as those few are there, `paged_jax.worker.warmup.jobs` puts them first), never for the whole warm-up.

A compile that failed fails the requests that need it (with its error), alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from paged_jax.sched.sequence import TokenSequence
from paged_jax.worker.compile_worker import CompileWorker
from paged_jax.worker.ready_shapes import StepNeeds, request_flags
from paged_jax.worker.runner import ModelRunner

WAIT_S = 0.05  # how long a step with nothing to run waits for a compile before the engine loop looks again


def seq_needs(needs: StepNeeds, seq: TokenSequence) -> StepNeeds:
    """`needs` and those of `seq`'s request."""
    return needs.with_request(seq.params, seq.needs_prompt_logprobs, len(seq.forked_children), seq.lora is not None)


def running_needs(running: Iterable[TokenSequence]) -> StepNeeds:
    """The needs of every sequence in `running` (each distinct kind of request combined once, the sequences and
    children counted: this runs every step)."""
    kinds, seqs, forks = set(), 0, 0
    for seq in running:
        kinds.add((request_flags(seq.params), seq.needs_prompt_logprobs, seq.lora is not None))
        seqs, forks = seqs + 1, forks + len(seq.forked_children)
    needs = StepNeeds()
    for flags, prompt_logprobs, lora in kinds:
        needs = needs.with_flags(flags, prompt_logprobs, lora=lora, seqs=0)
    return replace(needs, forks=forks, seqs=seqs)


@dataclass(slots=True)
class StepGate:
    """One step's gate: the token budget (None: uncapped) and the admission predicate (None: admit all)."""

    budget: int | None = None
    admit: Callable[[TokenSequence], bool] | None = None
    failed: list[tuple[TokenSequence, str]] = field(default_factory=list)  # requests to fail: (seq, why)


class CompileGate:
    """The admission gate of one engine's runner (see the module docstring)."""

    def __init__(self, runner: ModelRunner, merge: bool) -> None:
        self.runner = runner
        self.shapes = runner.ready_shapes
        self.merge = merge  # steps merge pending ids (async scheduling)
        self.worker = CompileWorker(runner.compile_now, self.shapes.ready)
        self.deferred: set[str] = set()  # request ids the last step held back for a compile
        self.cap: int | None = None  # the last step's token budget

    @property
    def waiting(self) -> bool:
        """Some request waits for a compile (the engine has work even when a step schedules nothing)."""
        return bool(self.deferred) and self.worker.busy > 0

    def plan(self, running: Iterable[TokenSequence]) -> StepGate:
        """This step's gate, from the requests running now."""
        needs = running_needs(running)
        cap = self.shapes.cap(needs, self.merge)
        # Nothing compiled yet (a cold start): a request is admitted once its smallest step is compiled.
        self.cap = cap = self.runner.token_buckets[0] if cap is None else cap
        self.deferred = set()
        gate = StepGate(cap)
        admitted = [needs]

        def admit(seq: TokenSequence) -> bool:
            more = seq_needs(admitted[0], seq)
            missing = self.shapes.missing(cap, more, self.merge)
            if not missing:
                admitted[0] = more
                return True
            failed = [self.worker.failed[j.key] for j in missing if j.key in self.worker.failed]
            if failed:
                gate.failed.append((seq, f"compiling its step shapes failed: {type(failed[0]).__name__}: {failed[0]}"))
            else:
                self.worker.want(missing)
                self.deferred.add(seq.request_id)
            return False

        gate.admit = admit
        return gate

    def after(self, num_tokens: int, running: Iterable[TokenSequence]) -> None:
        """A step of `num_tokens` was scheduled: when it filled a cap below the largest bucket, compile the next
        bucket up for the running requests (a server's background warm-up compiles it anyway; this is for
        engines without one)."""
        cap, buckets = self.cap, self.runner.token_buckets
        if cap is None or num_tokens < cap or cap >= buckets[-1]:
            return
        needs = running_needs(running)
        self.worker.want(self.shapes.missing(buckets[buckets.index(cap) + 1], needs, self.merge))

    def wait(self) -> None:
        """Nothing could run: wait a little for a compile to finish (a request is waiting for it)."""
        self.worker.wait(WAIT_S)
