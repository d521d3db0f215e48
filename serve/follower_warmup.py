"""A follower's warm-up for `paged-jax serve --distributed`: compile the step shapes process 0 compiles, meanwhile.

Process 0 compiles its serving plans (`paged_jax.worker.warmup.serving_plans`: the decode shapes before it reports
SERVING, then every other shape in the background) while it listens. Every process runs each step's executables
(their collectives span the hosts), so a follower that compiled nothing compiles each shape when the first step
using it arrives, and that step waits for it on every process. `start` compiles the same plans on a daemon thread
of the follower while it replays steps (`serve.multihost.follow`); a step whose executable that thread is still
compiling waits for that compile (the executable registry claims each key once) rather than starting its own.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import jax

from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.worker.warmup import serving_plans

log = logging.getLogger(__name__)


def compiled(engine: LLMEngine) -> int:
    """Executables the runner has compiled or loaded from the executable store so far."""
    stats = engine.runner.compile_stats
    return stats.count + stats.loaded


@dataclass(slots=True)
class FollowerWarmup:
    """The follower's warm-up thread and what it counted (`start`)."""

    engine: LLMEngine
    thread: threading.Thread | None = None
    compiled_at_end: int | None = None
    """`compiled` when the warm-up finished (None: it has not, or it failed)."""

    def report(self) -> None:
        """Log how many executables this follower compiled after its warm-up: steps that waited for a compile."""
        me = jax.process_index()
        if self.compiled_at_end is None:
            log.info("multi-host follower %d: stopped before its warm-up finished", me)
            return
        after = compiled(self.engine) - self.compiled_at_end
        log.info("multi-host follower %d: %d executables compiled after its warm-up (steps that waited)", me, after)


def start(engine: LLMEngine) -> FollowerWarmup:
    """Compile `engine`'s serving plans on a daemon thread (the process may end while it runs: the STOP of
    process 0 ends the follower at once); a failure is logged, and what it missed compiles at first use."""
    ec = engine.engine_config
    first, rest = serving_plans(ec.max_num_seqs, ec.async_scheduling)
    me = jax.process_index()
    out = FollowerWarmup(engine)

    def work() -> None:
        try:
            n = engine.warmup(first, False, what="follower warm-up")
            n += engine.warmup(rest, False, what="follower background warm-up")
        except Exception:  # noqa: BLE001 - the steps compile what it missed when they first need it
            log.exception("multi-host follower %d: warm-up failed; the shapes it missed compile at first use", me)
            return
        out.compiled_at_end = compiled(engine)
        log.info("multi-host follower %d: warm-up done, %d step shapes compiled", me, n)

    out.thread = threading.Thread(target=work, name="follower-warm-up", daemon=True)
    out.thread.start()
    return out
