"""The executable store: a second runner with the same store loads every executable without lowering or
compiling it and produces the same tokens; a changed shape or option misses; an entry that cannot be loaded
is logged once and compiled again. Every store lives under tmp_path (nothing under ~/.cache)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.executable_store import ExecutableStore, open_store
from paged_jax.worker.executables import persistent_cache_summary
from paged_jax.worker.runner import EXECUTABLES
from paged_jax.worker.warmup import jobs, plan_for_requests

from support.engines import make_engine

PROMPTS = [list(range(3 + i, 30 + 3 * i)) for i in range(3)]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0)


def engine(tiny_config, tiny_params, store: Path, **options) -> LLMEngine:
    # num_pages unique to this module: no other module's executables are shared with these engines.
    options = {"num_pages": 83, "max_num_seqs": 4, "attention_backend": "auto"} | options
    return make_engine(tiny_config, tiny_params, executable_store=str(store), **options)


def warm_and_run(e: LLMEngine) -> list[list[int]]:
    e.warmup(plan_for_requests([(len(p), PARAMS) for p in PROMPTS], e.engine_config.max_num_batched_tokens))
    for i, prompt in enumerate(PROMPTS):
        e.add_request(str(i), prompt, PARAMS)
    out: dict[str, list[int]] = {}
    while e.has_unfinished():
        for r in e.step():
            if r.finished:
                out[r.request_id] = list(r.outputs[0].token_ids)
    assert e.stats().compiles_after_warmup == 0
    return [out[str(i)] for i in range(len(PROMPTS))]


@pytest.fixture
def fresh():
    """Each engine of a test starts with no executable in the process (as a new process would)."""
    EXECUTABLES.clear()
    yield
    EXECUTABLES.clear()


def test_a_second_runner_loads_every_executable_and_compiles_none(tiny_config, tiny_params, tmp_path, fresh):
    store = tmp_path / "store"
    first = engine(tiny_config, tiny_params, store)
    planned = len(jobs(first.runner, plan_for_requests([(len(p), PARAMS) for p in PROMPTS], 64)))
    tokens = warm_and_run(first)
    s = first.stats()
    assert s.compile_count == planned and s.executables_loaded == 0
    assert len(list(store.glob("*.exe"))) == planned and open_store(str(store)).stats.writes >= planned
    EXECUTABLES.clear()
    second = engine(tiny_config, tiny_params, store)
    xla = persistent_cache_summary()["requests"]  # every XLA compile of the process
    again = warm_and_run(second)
    s = second.stats()
    assert s.executables_loaded == planned and s.compile_count == 0 and s.compile_lower_seconds == 0.0
    assert persistent_cache_summary()["requests"] == xla  # nothing compiled, not even a cache lookup
    assert again == tokens


def test_a_changed_shape_or_option_misses(tiny_config, tiny_params, tmp_path, fresh):
    store = tmp_path / "store"
    warm_and_run(engine(tiny_config, tiny_params, store))
    EXECUTABLES.clear()
    bigger = engine(tiny_config, tiny_params, store, max_num_batched_tokens=128)  # one more token bucket
    warm_and_run(bigger)
    s = bigger.stats()
    # the step shapes of the 64-token engine load; the 128-token bucket's forward and merge are new
    assert s.executables_loaded > 0 and s.compile_count == 2
    runner = bigger.runner
    job = runner.jobs.forward(16, 8)
    other = job.key[:-1] + ((("xla_cpu_use_onednn", True),),)
    digests = ExecutableStore(store)
    assert digests.digest(job.key) != digests.digest(other)
    assert digests.digest(job.key) != digests.digest(runner.jobs.forward(32, 8).key)
    assert digests.path(job.key).exists() and not digests.path(other).exists()


def test_an_entry_that_cannot_be_loaded_is_logged_once_and_compiled(tiny_config, tiny_params, tmp_path, fresh, caplog):
    store = tmp_path / "store"
    tokens = warm_and_run(engine(tiny_config, tiny_params, store))
    entries = sorted(store.glob("*.exe"))
    for p in entries[:-1]:
        p.write_bytes(b"not an executable")
    entries[-1].write_bytes(entries[-1].read_bytes()[:1000])  # truncated
    EXECUTABLES.clear()
    again = engine(tiny_config, tiny_params, store)
    with caplog.at_level(logging.WARNING, logger="paged_jax.worker.executable_store"):
        assert warm_and_run(again) == tokens
    s = again.stats()
    assert s.executables_loaded == 0 and s.compile_count == len(entries)
    assert open_store(str(store)).stats.rejected == len(entries)
    lines = [r.getMessage() for r in caplog.records if "could not be loaded" in r.getMessage()]
    assert len(lines) == 1 and str(store) in lines[0]  # once, naming the entry
    EXECUTABLES.clear()
    third = engine(tiny_config, tiny_params, store)  # the rejected entries were rewritten
    assert warm_and_run(third) == tokens and third.stats().executables_loaded == len(entries)


def test_entries_unused_for_two_weeks_are_pruned_and_a_load_marks_one_used(tmp_path):
    import os
    import time

    import jax
    import jax.numpy as jnp

    from paged_jax.worker import executable_store

    stale, kept = tmp_path / "stale.exe", tmp_path / "kept.exe"
    for p in (stale, kept):
        p.write_bytes(b"old")
    month_ago = time.time() - 30 * 86400
    os.utime(stale, (month_ago, month_ago))
    store = ExecutableStore(tmp_path)
    compiled = jax.jit(lambda x: x * 3 + 1).lower(jax.ShapeDtypeStruct((4,), jnp.float32)).compile()
    store.save(("triple",), compiled)
    assert not stale.exists() and kept.exists() and store.path(("triple",)).exists()
    entry = store.path(("triple",))
    os.utime(entry, (month_ago, month_ago))
    loaded = store.load(("triple",))
    assert entry.stat().st_mtime > time.time() - executable_store.UNUSED_DAYS * 86400
    assert jnp.array_equal(loaded(jnp.arange(4, dtype=jnp.float32)), jnp.arange(4) * 3 + 1)
    assert store.load(("other",)) is None and store.stats.misses == 1 and store.stats.rejected == 0


def test_an_executable_xla_cannot_serialize_is_logged_and_compiled_by_the_next_runner(
    tiny_config, tiny_params, tmp_path, fresh, caplog, monkeypatch
):
    """XLA:CPU (jax 0.11.2) cannot serialize a oneDNN fusion: a bfloat16 forward step compiled with oneDNN dots
    (`paged_jax.worker.xla_flags`, forced on here) is not stored, says so once, and is compiled again."""
    import jax

    from paged_jax.worker.runner import ModelRunner

    monkeypatch.setenv("PAGED_JAX_ONEDNN", "1")
    monkeypatch.setenv("PAGED_JAX_CPU_GEMM", "0")  # XLA's dots (a packed runner asks for no oneDNN dots)
    config = tiny_config.replace(dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype("bfloat16"), tiny_params)

    def runner() -> ModelRunner:
        shape = {"num_pages": 83, "page_size": 16, "max_model_len": 256, "max_num_seqs": 8}
        return ModelRunner(config, params, **shape, max_num_batched_tokens=32, executable_store=str(tmp_path))

    first = runner()
    assert first.jobs.forward(32, 8).options  # the oneDNN dot options
    with caplog.at_level(logging.WARNING, logger="paged_jax.worker.executable_store"):
        first.compile([first.jobs.forward(32, 8), first.jobs.forward(16, 8)], workers=1)
    assert [r.getMessage() for r in caplog.records if "oneDNN" in r.getMessage()]
    EXECUTABLES.clear()
    second = runner()
    second.compile([second.jobs.forward(32, 8), second.jobs.forward(16, 8)], workers=1)
    assert second.compile_stats.loaded == 1 and second.compile_stats.count == 1  # the 16-token step has XLA's dots


def test_an_executable_from_the_persistent_cache_is_not_stored(tiny_config, tiny_params, tmp_path, fresh, monkeypatch):
    """JAX's persistent-cache hits are loaded executables, which XLA:CPU re-serializes without their compiled
    functions: storing one would make every later start fail on its first call. Counted as cache hits by the
    compile's own thread (`PROCESS.thread_hits`), they are compiled into the runner but never written."""
    from paged_jax.worker import executables

    calls = iter(range(0, 10_000, 1))  # before / after each compile: a hit every time
    monkeypatch.setattr(executables.PROCESS, "thread_hits", lambda: next(calls))
    store = tmp_path / "store"
    e = engine(tiny_config, tiny_params, store)
    warm_and_run(e)
    assert e.stats().compile_count > 0 and e.stats().compile_cache_hits == e.stats().compile_count
    assert list(store.glob("*.exe")) == []
