"""`LLM(...)` start-up, counted: which executables it compiles before it returns, that every other shape is
compiled once on its first use and never again, and that its executables go to the compile cache's store
(`$PAGED_JAX_COMPILE_CACHE`) from which the next start loads them all."""

from __future__ import annotations

import logging

import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.engine import compile_cache
from paged_jax.worker.executables import persistent_cache_summary
from paged_jax.worker.runner import EXECUTABLES
from paged_jax.worker.warmup import WarmupPlan, first_use_plan, jobs

# 3 token buckets (16, 32, 64) and one sequence bucket (8): the plan's numbers below follow from these.
OPTIONS = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "attention_backend": "xla"}
# A forward step per token bucket, the default parameters' sampler variant (temperature 1: one variant, 8
# rows) and the lookahead's merge per token bucket.
STARTUP_EXECUTABLES = 3 + 1 + 3
PROMPTS = [{"prompt_token_ids": list(range(3 + i, 3 + 5 * (i + 1)))} for i in range(4)]  # 5..20 tokens


def test_start_up_compiles_only_the_first_use_plan_and_each_later_shape_once(capsys, caplog):
    """num_pages unique to this test: its executables are not shared with the other tests' engines."""
    llm = LLM("tiny", num_pages=61, **OPTIONS)  # no compile cache in tests (conftest)
    stats = llm.stats()
    assert (stats.compile_count, stats.executables_loaded, stats.compiles_after_warmup) == (STARTUP_EXECUTABLES, 0, 0)
    assert len(jobs(llm.engine.runner, WarmupPlan())) == 23  # every shape (each sampler variant with bias columns)
    assert "paged-jax: ready in" in capsys.readouterr().err
    hot = SamplingParams(max_tokens=6, seed=3)  # the default parameters' variant: compiled at start-up
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    llm.generate(PROMPTS, hot, use_tqdm=False)
    assert llm.stats().compile_count == STARTUP_EXECUTABLES
    with caplog.at_level(logging.INFO, logger="paged_jax.worker.executables"):
        first = llm.generate(PROMPTS, greedy, use_tqdm=False)  # greedy sampling of 8 rows: its first use
    assert llm.stats().compile_count == STARTUP_EXECUTABLES + 1 and llm.stats().compiles_after_warmup == 1
    assert [r.levelname for r in caplog.records] == ["INFO"]  # on purpose, so no warning
    assert "compiling sample rows=8" in capsys.readouterr().err  # the bar the waiting call showed
    xla = persistent_cache_summary()["requests"]  # every XLA compile of the process, not only the steps'
    again = llm.generate(PROMPTS, greedy, use_tqdm=False)
    llm.generate(PROMPTS, hot, use_tqdm=False)
    assert llm.stats().compile_count == STARTUP_EXECUTABLES + 1 and persistent_cache_summary()["requests"] == xla
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]


def test_the_executables_go_to_the_compile_cache_and_the_next_start_loads_them(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path))
    # JAX's persistent cache is process-wide: it stays off here, so later tests never depend on this directory
    # (`compile_cache.use_compile_cache` turns it on in every real process; the store below is the real one).
    turned_on: list[str] = []
    monkeypatch.setattr(compile_cache, "enable_persistent_cache", turned_on.append)
    store = tmp_path / "executables"
    first = LLM("tiny", num_pages=62, **OPTIONS)
    assert turned_on == [str(tmp_path)] and first.engine.engine_config.executable_store == str(store)
    assert len(list(store.glob("*.exe"))) == STARTUP_EXECUTABLES
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    expected = [o.outputs[0].token_ids for o in first.generate(PROMPTS, greedy, use_tqdm=False)]
    assert len(list(store.glob("*.exe"))) == STARTUP_EXECUTABLES + 1  # the first-use compile is stored too
    EXECUTABLES.clear()  # as in a new process: nothing compiled
    second = LLM("tiny", num_pages=62, **OPTIONS)
    stats = second.stats()
    assert (stats.compile_count, stats.executables_loaded) == (0, STARTUP_EXECUTABLES)
    assert [o.outputs[0].token_ids for o in second.generate(PROMPTS, greedy, use_tqdm=False)] == expected
    assert (second.stats().compile_count, second.stats().executables_loaded) == (0, STARTUP_EXECUTABLES + 1)
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert LLM("tiny", num_pages=62, warmup=False, **OPTIONS).engine.engine_config.executable_store is None


@pytest.mark.slow  # two engines' start-up compiles (about 40 CPU seconds)
def test_lora_and_speculative_engines_compile_their_start_up_plan_and_nothing_in_steady_state(tmp_path):
    """The LoRA and the n-gram speculative `LLM`: start-up compiles the base plan plus the LoRA slot write (LoRA)
    or exactly its own first-use plan (speculative: the verify steps hold k + 1 tokens a sequence, so more token
    and sequence buckets), a first generate compiles what it needs once, and a second identical generate
    compiles nothing."""
    from paged_jax.config import load_model_config
    from paged_jax.lora import LoRARequest
    from paged_jax.lora.random_adapter import write_adapter

    adapter = write_adapter(tmp_path / "a", load_model_config("tiny"), rank=4)
    cases = {
        "lora": ({"enable_lora": True, "max_loras": 2, "max_lora_rank": 4}, STARTUP_EXECUTABLES + 1),
        "ngram": ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}, None),
    }
    for i, (name, (options, at_start)) in enumerate(cases.items()):
        llm = LLM("tiny", num_pages=63 + i, **OPTIONS, **options)
        if at_start is None:
            ec = llm.engine.engine_config
            at_start = len(
                jobs(llm.engine.runner, first_use_plan(SamplingParams(**ec.sampling_defaults), ec.async_scheduling))
            )
            assert at_start > STARTUP_EXECUTABLES  # the verify steps' buckets
        assert (llm.stats().compile_count, llm.stats().compiles_after_warmup) == (at_start, 0), name
        lora = LoRARequest("a", 1, str(adapter)) if name == "lora" else None
        params = SamplingParams(max_tokens=8, seed=1)
        first = llm.generate(PROMPTS * 2, params, use_tqdm=False, lora_request=lora)
        compiled = llm.stats().compile_count
        again = llm.generate(PROMPTS * 2, params, use_tqdm=False, lora_request=lora)
        assert llm.stats().compile_count == compiled, name  # steady state: nothing new
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first], name
