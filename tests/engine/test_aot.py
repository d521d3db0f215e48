"""The abstract engine (paged_jax.engine.aot) that the TPU and GPU compile checks compile: the engine's own runner,
sized as the engine sizes itself, with nothing allocated, lowering to the same step as a real runner."""

import jax
import pytest

from paged_jax.config.engine import EngineConfig
from paged_jax.engine.aot import abstract_engine, step_job, step_shape, verify_sample_job
from paged_jax.engine.llm_engine import make_runner
from paged_jax.model import quant
from paged_jax.worker.kv_budget import kv_capacity_pages
from paged_jax.worker.step_functions import LoraShape

LIMIT = 2**30  # bytes one device reports


def test_sized_like_the_engine_and_nothing_allocated(tiny_config):
    ec = EngineConfig(attention_backend="xla", enable_lora=True, max_loras=2, scan_layers="on")
    engine = abstract_engine(tiny_config, ec, jax.devices()[:1], LIMIT)
    runner = engine.runner
    kv_dtype = quant.kv_cache_dtype(None, tiny_config.dtype)
    stats = {"bytes_limit": LIMIT, "bytes_in_use": engine.weights_bytes}
    pages = kv_capacity_pages(tiny_config, ec, kv_dtype, memory_stats=stats)
    assert pages == (LIMIT - engine.weights_bytes) * 0.9 // (quant.kv_bytes_per_token(tiny_config, kv_dtype) * 16)
    leaves = jax.tree.leaves((runner.params, runner.kv_caches, runner.lora_weights))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert runner.scan  # LoRA engines scan too (as "auto" does on TPU and GPU): one page array stacked over the layers
    assert engine.local_kv_shape[0] == pages * tiny_config.num_layers and engine.kv_tokens == (pages - 1) * 16
    assert runner.lora == LoraShape(2, 16)
    per_layer = quant.kv_bytes_per_token(tiny_config, kv_dtype) // tiny_config.num_layers
    assert engine.layer_kv_bytes == pages * 16 * per_layer
    with pytest.raises(RuntimeError, match="abstract"):
        runner.launch(None)


def test_lowers_the_same_step_as_a_real_runner(tiny_config, tiny_params):
    """The abstract runner's forward job is the real runner's, operand for operand (a LoRA engine: 7 operands)."""
    ec = EngineConfig(attention_backend="xla", num_pages=40, max_model_len=256, enable_lora=True)
    engine = abstract_engine(tiny_config, ec, jax.devices()[:1], LIMIT)
    real = make_runner(tiny_config, tiny_params, ec, 40, 256, None)
    for kind in ("decode", "prefill"):
        abstract, concrete = engine.lower(step_job(engine.runner, kind)), step_job(real, kind).lower()
        assert abstract.in_tree == concrete.in_tree and len(abstract.in_tree.children()[0].children()) == 7
        assert _operands(abstract.args_info) == _operands(concrete.args_info)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), abstract.out_info) == jax.tree.map(
            lambda x: (x.shape, x.dtype), concrete.out_info
        )


def _operands(args_info) -> list[tuple]:
    return [(x.shape, x.dtype, x.donated) for x in jax.tree.leaves(args_info)]


def test_step_shapes():
    """decode: max_num_seqs tokens; prefill: the token budget; verify: every sequence with all its drafts."""
    from paged_jax.config import load_model_config

    config = load_model_config("tiny")
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    ec = EngineConfig(attention_backend="xla", num_pages=40, speculative_config=spec)
    runner = abstract_engine(config, ec, jax.devices()[:1], LIMIT).runner
    assert [step_shape(runner, k) for k in ("decode", "prefill", "verify")] == [(64, 64), (512, 64), (256, 256)]
    assert verify_sample_job(runner).key[2] == 256
    plain = abstract_engine(config, EngineConfig(attention_backend="xla", num_pages=40), jax.devices()[:1], LIMIT)
    with pytest.raises(ValueError, match="speculative_config"):
        step_shape(plain.runner, "verify")
