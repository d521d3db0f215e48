"""Which draft-model steps may run without compiling, so that no request waits behind a draft compile?

With `EngineConfig.background_compiles` (the server's setting) the target's steps never compile
(`paged_jax.engine.compile_gate`); the draft model's runner has its own executables, and a proposal whose draft
step is not compiled would stall the engine thread for that compile. Drafts are optional (a step without them
decodes one token, exactly as it would have), so the draft's gate is simpler than the target's: a proposal runs
only inside the largest token bucket whose draft step (forward at its largest sequence bucket, greedy sampling)
is compiled. Catch-up chunks are cut to that bucket, at most that many sequences get drafts, and the rest get
none this step. The missing executables are compiled on the draft's own compile thread
(`paged_jax.worker.compile_worker`), smallest bucket first, then the next bucket up whenever a proposal was cut
by the cap. The draft runner runs each step in the smallest compiled shapes that hold it
(`ModelRunner.resolve_shapes`).
"""

from __future__ import annotations

from paged_jax.worker.compile_worker import CompileWorker
from paged_jax.worker.ready_shapes import StepNeeds
from paged_jax.worker.runner import ModelRunner


class DraftGate:
    """The compile gate of a draft model's runner (see the module docstring)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        runner.resolve_shapes = True
        self.worker = CompileWorker(runner.compile_now, runner.ready_shapes.ready)

    def cap(self) -> int | None:
        """The largest token bucket a draft step may fill now; None (after asking for the smallest bucket's
        executables) when none is compiled yet."""
        cap = self.runner.ready_shapes.cap(StepNeeds(), merge=False)
        if cap is None:
            self.worker.want(self.runner.ready_shapes.missing(self.runner.token_buckets[0], StepNeeds(), False))
        return cap

    def grow(self, cap: int) -> None:
        """A proposal was cut at `cap`: compile the next token bucket up (when there is one)."""
        buckets = self.runner.token_buckets
        if cap < buckets[-1]:
            self.worker.want(self.runner.ready_shapes.missing(buckets[buckets.index(cap) + 1], StepNeeds(), False))

    def close(self, timeout: float | None = None) -> None:
        """Start no more draft compiles; wait up to `timeout` for the running one (shut-down)."""
        self.worker.close(timeout)
