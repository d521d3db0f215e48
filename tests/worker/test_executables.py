"""The executable registry: compile once per key, count every compile, and let go of executables on `clear`."""

from __future__ import annotations

import gc
import os

import jax
import jax.numpy as jnp
import pytest

from paged_jax.worker.executables import CompileStats, Executables


def job(n: int):
    return lambda: jax.jit(lambda x: jnp.sin(x) * n + 1.0).lower(jax.ShapeDtypeStruct((n + 2,), jnp.float32))


def test_one_compile_per_key_then_clear_compiles_again():
    registry, stats = Executables(), CompileStats()
    first = registry.get("a", job(1), stats)
    assert registry.get("a", job(1), stats) is first and stats.count == 1 and len(registry) == 1
    registry.clear()
    assert "a" not in registry and len(registry) == 0
    again = registry.get("a", job(1), stats, warm=True)
    assert again is not first and stats.count == 2 and stats.after_warmup == 1
    x = jnp.arange(3, dtype=jnp.float32)
    assert jnp.allclose(again(x), jnp.sin(x) + 1.0)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux memory maps")
def test_clear_returns_the_executables_memory_maps():
    """XLA:CPU maps memory for each executable; a registry that kept them all would, over a long process, pass
    the kernel's vm.max_map_count and crash the next compile."""

    def maps() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    registry, stats = Executables(), CompileStats()
    jax.clear_caches()
    gc.collect()
    before = maps()
    registry.compile_all([(n, job(n), ()) for n in range(40)], stats, workers=1)
    grown = maps() - before
    assert grown >= 40, grown  # each executable holds maps of its own
    registry.clear()
    jax.clear_caches()
    gc.collect()
    assert maps() - before < grown / 4, (before, grown, maps())
