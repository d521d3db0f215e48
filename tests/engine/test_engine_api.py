"""The `Engine` protocol and `EngineStats`: both engines offer the whole surface; replicas' stats combine."""

from __future__ import annotations

import dataclasses

import pytest

from paged_jax.engine.data_parallel import DataParallelEngine
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.protocol import Engine, EngineStats


def test_both_engines_offer_every_method_and_property_of_the_protocol():
    members = {n for n, v in vars(Engine).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    assert {"add_request", "step", "abort", "fail", "has_unfinished", "stats", "max_n", "num_running"} <= members
    for cls in (LLMEngine, DataParallelEngine):
        assert not [n for n in members if not hasattr(cls, n)], cls


def stats(**counts) -> EngineStats:
    zero = {f.name: 0 for f in dataclasses.fields(EngineStats) if f.name not in ("replicas", "kv_groups")}
    return EngineStats(**(zero | counts))


def test_replica_stats_combine_by_sums_and_recomputed_rates():
    a = stats(
        pages_total=10,
        pages_in_use=4,
        slot_utilization=0.5,
        prefix_queries=100,
        prefix_hits=50,
        prefix_hit_rate=0.5,
        num_preemptions=1,
        compile_seconds=1.5,
        step_tokens=7,
    )
    b = stats(
        pages_total=10,
        pages_in_use=1,
        slot_utilization=1.0,
        prefix_queries=300,
        prefix_hits=0,
        num_preemptions=2,
        compile_seconds=0.5,
        step_tokens=3,
    )
    c = EngineStats.combine([a, b])
    assert c.kv_groups == ()
    assert (c.pages_total, c.pages_in_use, c.num_preemptions, c.step_tokens) == (20, 5, 3, 10)
    assert c.compile_seconds == pytest.approx(2.0)
    assert c.prefix_hit_rate == pytest.approx(50 / 400)  # from the summed counts, not the mean of the rates
    assert c.slot_utilization == pytest.approx((0.5 * 4 + 1.0 * 1) / 5)  # weighted by pages in use
    assert c.pages_in_use_ratio == pytest.approx(5 / 20) and c.replicas == (a, b)
    idle = EngineStats.combine([stats(pages_total=4), stats(pages_total=4)])
    assert idle.slot_utilization == 1.0 and idle.prefix_hit_rate == 0.0
