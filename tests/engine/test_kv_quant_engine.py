"""Quantized KV pages through the engine: allocation, the capacity gain, and that paging, prefix caching and
copy-on-write forks move values *and* scales (a quantized page read back without its own scales would change
the tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.kv_cache.invariants import check_manager_invariants
from paged_jax.sampling_params import SamplingParams
from pallas_kernels.kv_quant import QuantizedPages

from support.engines import make_engine


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[list[int]]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    out: dict[str, list[list[int]]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = [c.token_ids for c in o.outputs]
    check_manager_invariants(engine.kv)
    assert engine.kv.stats().pages_in_use == 0
    return out


def prompts(seed: int, n: int, shared: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 259, shared).tolist()
    return [prefix + rng.integers(3, 259, int(rng.integers(5, 40))).tolist() for _ in range(n)]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_quantized_cache_allocation_and_stats(tiny_config, tiny_params, kv_dtype):
    engine = make_engine(tiny_config, tiny_params, kv_dtype=kv_dtype)
    cache = engine.runner.layer_cache(0)
    assert isinstance(cache, QuantizedPages) and cache.pages.dtype.itemsize == 1
    stats = engine.stats()
    d = tiny_config.head_dim
    assert engine.runner.kv_dtype.name in ("int8", "float8_e4m3fn")
    assert stats.kv_cache_token_gain == pytest.approx(4 * d / (2 * d + 8), abs=1e-3)  # bf16 vs int8 + scales
    assert stats.kv_cache_tokens == 95 * engine.engine_config.page_size


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_prefix_caching_and_forks_keep_scales(tiny_config, tiny_params, kv_dtype):
    """Greedy tokens with quantized KV do not depend on where the pages came from: computed fresh, served from
    the prefix cache, or shared and copied on write by n > 1 samples (a copy without its scales, or a cached
    page read with another page's scales, would change them)."""
    ps = prompts(0, 6, shared=40)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    fresh = run(make_engine(tiny_config, tiny_params, kv_dtype=kv_dtype, enable_prefix_caching=False), ps, greedy)
    engine = make_engine(tiny_config, tiny_params, kv_dtype=kv_dtype, enable_prefix_caching=True)
    cached = run(engine, ps, greedy)
    assert engine.kv.stats().prefix_hits > 0
    assert cached == fresh
    forks = run(
        make_engine(tiny_config, tiny_params, kv_dtype=kv_dtype),
        ps[:2],
        SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True),
    )
    for i in range(2):
        assert forks[f"r{i}"] == [fresh[f"r{i}"][0]] * 3


def test_quantized_kv_close_to_float_kv(tiny_config, tiny_params):
    """int8 KV changes few greedy tokens of the random tiny model (its logits are nearly flat, so this is a
    loose guard; the accuracy table in the note measures real models)."""
    ps = prompts(1, 8, shared=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = run(make_engine(tiny_config, tiny_params), ps, greedy)
    q8 = run(make_engine(tiny_config, tiny_params, kv_dtype="int8"), ps, greedy)
    same = sum(a == b for k in ref for a, b in zip(ref[k][0], q8[k][0], strict=True))
    total = sum(len(v[0]) for v in ref.values())
    assert same / total >= 0.8, same / total


_TP_CHILD = """
import json
from paged_jax.model import quant
from paged_jax.config import load_model_config
from paged_jax.config.engine import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.model.init import init_params
from paged_jax.sampling_params import SamplingParams
from paged_jax.tokenization.tokenizer import ByteTokenizer
config = load_model_config("tiny")
params = quant.quantize_params(init_params(config, seed=0), "int8")
out = {}
for tp in (1, 2):
    engine = LLMEngine(config, params, ByteTokenizer(), EngineConfig(
        num_pages=64, max_num_seqs=4, max_num_batched_tokens=64, attention_backend="xla", warmup=False,
        kv_dtype="int8", tensor_parallel_size=tp))
    engine.add_request("a", list(range(3, 60)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[tp] = o.outputs[0].token_ids
print(json.dumps(out))
"""


@pytest.mark.slow  # a fresh process (start-up and compiles)
def test_tensor_parallel_quantized_weights_and_kv():
    """TP 2 on two host devices (a child process: the device count is fixed at JAX start-up): int8 weights are
    sharded with their scales, int8 pages with theirs, and the greedy tokens equal TP 1's."""
    import json
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
    }
    res = subprocess.run(
        [sys.executable, "-c", _TP_CHILD], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["1"] == out["2"] and len(out["1"]) == 8
