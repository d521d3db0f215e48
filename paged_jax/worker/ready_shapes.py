"""Which step shapes can run now without compiling, and which compiled shape does a step use?

While a server warms up in the background (or a shape was left to its first use) a step can need an executable
that is not compiled yet. With `ModelRunner.resolve_shapes` on, the runner runs such a step in a compiled shape
that holds it instead: the smallest compiled token bucket >= its own with a compiled sequence bucket >= its own
(padding is inert: `paged_jax.worker.step_inputs`), the smallest compiled sampler variant that does at least what
the step's rows need (`covering`: a greedy row of a sampling variant takes the same argmax, a row without filters
keeps every token under the filtering variant, logprobs are extra outputs; penalties change the sampler's inputs,
so that flag must match), and the smallest compiled copy bucket >= its copies. Only when none exists does the
step compile (as without resolution).

`StepNeeds` is what the steps of a set of requests can need besides their tokens, and `missing(t, needs)` the
executables a step of token bucket `t` lacks for them: the engine's admission gate
(`paged_jax.engine.compile_gate`) keeps every step inside compiled shapes with it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.buckets import bucket_for
from paged_jax.worker.compile_jobs import CompileJobs, Job
from paged_jax.worker.executables import Executables
from paged_jax.worker.step_functions import GREEDY, LoraShape
from paged_jax.worker.step_inputs import SamplerFlags

_ALL_VARIANTS = tuple(SamplerFlags(*bits) for bits in itertools.product((False, True), repeat=4))


def request_flags(params: SamplingParams) -> SamplerFlags:
    """The sampler variant a step holding only this request uses (as `build_sampling_inputs` derives it)."""
    hot = params.temperature > 0
    return SamplerFlags(hot, hot and params.uses_filters, params.uses_penalties, params.logprobs is not None)


def union(a: SamplerFlags, b: SamplerFlags) -> SamplerFlags:
    """The variant a step holding rows of both variants uses (the element-wise OR)."""
    return SamplerFlags(a[0] or b[0], a[1] or b[1], a[2] or b[2], a[3] or b[3])


def covers(variant: SamplerFlags, flags: SamplerFlags) -> bool:
    """`variant`'s executable gives every row of a `flags` step the same tokens (see the module docstring)."""
    same_penalty = variant.do_penalty == flags.do_penalty
    return same_penalty and all(v or not f for v, f in zip(variant, flags, strict=True))


@dataclass(frozen=True, slots=True)
class StepNeeds:
    """What the steps of a set of requests can need besides their token count. `plain`: the sampler variant of
    all its rows without penalties (at least greedy: a step of prompt chunks samples nothing); `penalized`: that
    of all its rows, when some row has penalties (a step holds any subset of the rows, and a subset uses a
    variant below one of these two); `prompt_logprobs`; `forks`, the samples of n > 1 requests not forked yet
    (their leaders' children): the step that completes a leader's prompt samples one more row per child and the
    next copies up to one page per child, so a step of `t` tokens samples at most `fork_rows(t)` rows, `seqs`
    being the sequences counted; `lora` (an adapter may be written into a slot)."""

    plain: SamplerFlags = GREEDY
    penalized: SamplerFlags | None = None
    prompt_logprobs: bool = False
    forks: int = 0
    seqs: int = 0
    lora: bool = False

    def with_request(
        self, params: SamplingParams, prompt_logprobs: bool = False, forks: int = 0, lora: bool = False
    ) -> StepNeeds:
        """These needs and one more sequence's (`prompt_logprobs`: it still owes some; `forks`: its children
        not yet forked)."""
        return self.with_flags(request_flags(params), prompt_logprobs, forks, lora)

    def with_flags(
        self, flags: SamplerFlags, prompt_logprobs: bool = False, forks: int = 0, lora: bool = False, seqs: int = 1
    ) -> StepNeeds:
        """`with_request` of `seqs` sequences whose sampler variant is `flags` and children `forks` in all."""
        plain, penalized = self.plain, self.penalized
        if flags.do_penalty:
            penalized = union(flags, union(plain, penalized or flags))
        else:
            plain = union(plain, flags)
            penalized = None if penalized is None else union(penalized, flags)
        return StepNeeds(
            plain,
            penalized,
            self.prompt_logprobs or prompt_logprobs,
            self.forks + forks,
            self.seqs + seqs,
            self.lora or lora,
        )

    def fork_rows(self, t: int) -> int:
        """The most rows a step of `t` tokens samples: one per sequence it holds, and every child (0: no forks)."""
        return min(t, self.seqs) + self.forks if self.forks else 0

    @property
    def variants(self) -> tuple[SamplerFlags, ...]:
        return (self.plain,) if self.penalized is None else (self.plain, self.penalized)


class RunnerShapes(Protocol):
    """What `ReadyShapes` reads of a runner (`paged_jax.worker.runner.ModelRunner`): its jobs and buckets."""

    jobs: CompileJobs
    suppress_width: int
    history_len: int
    logit_bias_width: int
    lora: LoraShape | None

    @property
    def token_buckets(self) -> list[int]: ...

    @property
    def seq_buckets(self) -> list[int]: ...

    @property
    def copy_buckets(self) -> list[int]: ...

    def step_seq_buckets(self, t: int, forks: bool = False, fork_rows: int | None = None) -> list[int]: ...


class ReadyShapes:
    """A runner's view of which of its executables are compiled in `registry` (the process's)."""

    def __init__(self, runner: RunnerShapes, registry: Executables) -> None:
        self.runner = runner
        self.registry = registry
        # Answers of `missing` and `step_shape` (asked every step), valid while the registry's version holds.
        self._memo: dict[tuple, object] = {}
        self._version = -1

    def _cached(self, key: tuple, compute):  # noqa: ANN001, ANN202 - the memo of the two questions above
        if self.registry.version != self._version:
            self._memo, self._version = {}, self.registry.version
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def ready(self, job: Job) -> bool:
        return job.key in self.registry

    def _sample_job(self, s: int, flags: SamplerFlags) -> Job:
        r = self.runner
        history = r.history_len if flags.do_penalty else 1
        return r.jobs.sample(s, r.suppress_width, history, flags, r.logit_bias_width)

    def sampler(self, s: int, flags: SamplerFlags) -> SamplerFlags | None:
        """The cheapest compiled sampler variant of `s` rows that covers `flags` (`flags` itself first)."""
        candidates = sorted(
            (v for v in _ALL_VARIANTS if covers(v, flags)), key=lambda v: (v != flags, sum(v), tuple(v))
        )
        return next((v for v in candidates if self.ready(self._sample_job(s, v))), None)

    def step_jobs(self, t: int, s: int, flags: Iterable[SamplerFlags], merge: bool, prompt_logprobs: bool) -> list[Job]:
        """The executables a step of buckets (t, s) runs, the sampler as every variant in `flags` (their exact
        variants: `missing` asks for these to be compiled)."""
        r = self.runner
        flags = list(flags)
        out = [r.jobs.forward(t, s)]
        out += [self._sample_job(s, f) for f in flags]
        if any(f.do_penalty for f in flags):
            out.append(r.jobs.history(s))
        if merge:
            out.append(r.jobs.merge(t))
        if prompt_logprobs:
            out.append(r.jobs.prompt_logprobs(t))
        return out

    def missing(self, t: int, needs: StepNeeds, merge: bool) -> list[Job]:
        """The executables a step of token bucket `t` would compile for requests with `needs`, at the largest
        sequence bucket such a step can take (every smaller step then resolves to this one or below it), and
        with forks the copy bucket of one page per child. `merge`: the lookahead's merge of pending ids is
        needed (async scheduling)."""
        rows = needs.fork_rows(t)
        key = ("missing", t, needs.plain, needs.penalized, needs.prompt_logprobs, needs.forks, rows, needs.lora, merge)
        return list(self._cached(key, lambda: self._missing(t, needs, rows, merge)))

    def _missing(self, t: int, needs: StepNeeds, rows: int, merge: bool) -> list[Job]:
        r = self.runner
        s = r.step_seq_buckets(t, forks=needs.forks > 0, fork_rows=rows)[-1]
        out = []
        for job in self.step_jobs(t, s, (), merge, needs.prompt_logprobs):
            if not self.ready(job):
                out.append(job)
        for flags in needs.variants:
            if self.sampler(s, flags) is None:
                out.append(self._sample_job(s, flags))
        if needs.penalized is not None and not self.ready(r.jobs.history(s)):
            out.append(r.jobs.history(s))
        if needs.forks:
            copies = bucket_for(min(needs.forks, r.copy_buckets[-1]), r.copy_buckets)
            if not any(self.ready(r.jobs.copy(b)) for b in r.copy_buckets if b >= copies):
                out.append(r.jobs.copy(copies))
        if needs.lora and r.lora is not None and not self.ready(r.jobs.lora_write()):
            out.append(r.jobs.lora_write())
        return out

    def cap(self, needs: StepNeeds, merge: bool) -> int | None:
        """The largest token bucket whose step has every executable `needs` asks for (None: no bucket has)."""
        for t in reversed(self.runner.token_buckets):
            if not self.missing(t, needs, merge):
                return t
        return None

    def step_shape(
        self, t: int, s: int, flags: SamplerFlags, merge: bool, prompt_logprobs: bool
    ) -> tuple[int, int, SamplerFlags] | None:
        """The smallest compiled buckets (t', s') >= (t, s) and sampler variant covering `flags` with which a step
        runs without compiling; None when there is none (the step then compiles its own shapes)."""
        key = ("step", t, s, flags, merge, prompt_logprobs)
        return self._cached(key, lambda: self._step_shape(t, s, flags, merge, prompt_logprobs))

    def _step_shape(
        self, t: int, s: int, flags: SamplerFlags, merge: bool, prompt_logprobs: bool
    ) -> tuple[int, int, SamplerFlags] | None:
        r = self.runner
        for tt in (b for b in r.token_buckets if b >= t):
            for ss in (b for b in r.seq_buckets if b >= s):
                variant = self.sampler(ss, flags)
                if variant is None:
                    continue
                if all(self.ready(job) for job in self.step_jobs(tt, ss, (variant,), merge, prompt_logprobs)):
                    return tt, ss, variant
        return None

    def copy_bucket(self, n: int) -> int:
        """The smallest compiled copy bucket holding `n` copies (`n`'s own bucket when none is compiled)."""
        r = self.runner
        fits = [b for b in r.copy_buckets if b >= n]
        return next((b for b in fits if self.ready(r.jobs.copy(b))), fits[0])
