"""The warm-up's compile queue and a step that needs a shape: the step never waits behind the queue, and a
shape is compiled once whoever gets to it first; a compile after warm-up is a warning only when the warm-up
was meant to cover it."""

from __future__ import annotations

import logging
import threading

import jax
import jax.numpy as jnp

from paged_jax.worker.executables import CompileStats, Executables


def job(n: int):
    return lambda: jax.jit(lambda x: jnp.cos(x) * n - 2.0).lower(jax.ShapeDtypeStruct((n + 5,), jnp.float32))


def test_a_step_compiles_a_shape_the_warm_up_has_not_started_instead_of_waiting_for_it():
    registry, warm_stats, step_stats = Executables(), CompileStats(), CompileStats()
    started, release = threading.Event(), threading.Event()

    def blocked():  # the warm-up's one thread is busy with this job until the test releases it
        started.set()
        assert release.wait(120)  # a hang guard, not a timing assertion
        return job(1)()

    jobs = [("a", blocked, ()), ("b", job(2), ()), ("c", job(3), ())]
    done: list[list] = []
    warm_up = threading.Thread(target=lambda: done.append(registry.compile_all(jobs, warm_stats, workers=1)))
    warm_up.start()
    try:
        assert started.wait(120)
        c = registry.get("c", job(3), step_stats, warm=True, deferred=True)  # returns while "a" is still blocked
        assert (step_stats.count, step_stats.after_warmup) == (1, 1) and not release.is_set()
    finally:
        release.set()
        warm_up.join(120)
    assert done == [["a", "b"]] and warm_stats.count == 2  # "c" was not compiled again by the warm-up
    assert registry.get("c", job(3), step_stats) is c and step_stats.count == 1
    x = jnp.arange(8, dtype=jnp.float32)
    assert jnp.allclose(c(x), jnp.cos(x) * 3 - 2.0)


def test_a_deferred_shape_is_logged_as_info_with_a_progress_bar_and_a_missed_one_as_a_warning(caplog, capsys):
    registry, stats = Executables(), CompileStats()
    with caplog.at_level(logging.INFO, logger="paged_jax.worker.executables"):
        registry.get("first use", job(4), stats, warm=True, describe="sample rows=8", deferred=True, show=True)
        registry.get("first use", job(4), stats, warm=True, describe="sample rows=8", deferred=True, show=True)
        registry.get("missed", job(5), stats, warm=True, describe="forward tokens=16")
    levels = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert levels == [
        (logging.INFO, "compiling sample rows=8 on its first use"),
        (
            logging.WARNING,
            "compiling a new step shape after warm-up: forward tokens=16 (the step waits; warm-up missed it)",
        ),
    ]
    assert stats.count == stats.after_warmup == 2  # one compile per shape, however often a step asks
    err = capsys.readouterr().err
    assert err.count("compiling sample rows=8") >= 1 and "forward tokens=16" not in err
