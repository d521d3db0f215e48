"""The one-step lookahead (async scheduling), in one place.

With `EngineConfig.async_scheduling` the engine schedules and dispatches step n+1 before it waits for step n's
samples, so the host's scheduling and bookkeeping overlap the device's work. A sequence sampled by step n then
enters step n+1 with its newest token unknown on the host: its last output token is a placeholder (-1) and the
sequence carries one `PendingToken` record saying which row of step n's samples holds the real id. Everything
about that record lives here:

- `Lookahead.mark_pending` (engine, before launching step n+1): every sequence step n sampled gets its
  placeholder and its record; `PendingToken.is_last` says the token is its last for length alone, so the
  scheduler does not run it again.
- The scheduler schedules such a sequence as usual but does not offer its blocks to the prefix cache yet (a
  placeholder must not be hashed); the step inputs (`paged_jax.worker.step_inputs`) send `prev_rows` instead of the
  id, and `paged_jax.worker.pending`'s `merge_pending` / `merge_pending_history` take the ids from step n's
  samples on the device.
- `resolve` (engine, when step n's samples reach the host): the placeholder becomes the real id, the record is
  dropped, and the blocks it completed enter the prefix cache.

A sequence that step n finishes (EOS, a stop) costs one wasted token of step n+1, which is discarded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax

from paged_jax.kv_cache import KVCacheManager
from paged_jax.sched.output import SchedulerOutput
from paged_jax.sched.sequence import PLACEHOLDER, PendingToken, Status, TokenSequence
from paged_jax.worker.prompt_logprobs import PromptLogprobs
from paged_jax.worker.runner import ForwardLaunched
from paged_jax.worker.sampler import SamplerOutput


class Launched(NamedTuple):
    """A step dispatched to the device and not yet collected."""

    sched: SchedulerOutput
    samples: SamplerOutput | None  # on device; None while a structured-output step's sampling waits for masks
    host_seconds: float  # host time spent launching
    forward: ForwardLaunched | None = None  # the forward half, while `samples` is None
    prompt_logprobs: PromptLogprobs | None = None  # on device, when the step has prompt-logprob positions
    pooled: jax.Array | None = None  # [S, H] on device, when the step pools (`paged_jax.worker.pooling`)
    late: frozenset[int] = frozenset()  # sample rows whose mask passed the fill budget (`paged_jax.structured.rows`)


class Lookahead:
    """The engine's in-flight step, and the pending records of the sequences it sampled."""

    def __init__(self) -> None:
        self.inflight: Launched | None = None

    def take(self) -> Launched | None:
        """The in-flight step (None if there is none); it is no longer in flight."""
        launched, self.inflight = self.inflight, None
        return launched

    @staticmethod
    def mark_pending(
        launched: Launched, is_live: Callable[[TokenSequence], bool], is_last: Callable[[TokenSequence], bool]
    ) -> None:
        """Give every live sequence `launched` samples a placeholder token and its `PendingToken`.

        `is_live`: the sequence still runs (not finished, aborted or failed); `is_last(seq)`, asked after the
        placeholder is appended: that token ends it by length."""
        for row, sample in enumerate(launched.sched.sample_rows):
            seq = sample.seq
            if not is_live(seq):
                continue
            seq.append_token(PLACEHOLDER)
            seq.pending = PendingToken(row, is_last(seq))

    @staticmethod
    def resolve(seq: TokenSequence, token: int, kv: KVCacheManager) -> bool:
        """Put the sampled `token` in place of `seq`'s placeholder and cache the blocks it completed; False
        (nothing done) when `seq` has no pending token."""
        if seq.pending is None:
            return False
        seq.set_last_token(token)
        seq.pending = None
        if seq.status is Status.RUNNING:
            kv.cache_blocks(seq.seq_id, seq.all_token_ids)
        return True
