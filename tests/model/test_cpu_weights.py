"""The CPU-weights record (paged_jax.model.cpu_weights): projections packed once for the CPU GEMM, read by the
model in place of its parameters. Packed and plain forwards agree on random weights (float32 to rounding,
bfloat16 within its rounding), the record holds exactly the projections and the LM head (tied: packed from the
embedding, which stays), quantized weights stay on XLA's dots, and the CPU runner packs by default and calls the
GEMM for every projection of its compiled decode step."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.engine.aot import step_job
from paged_jax.model import quant
from paged_jax.model.attention import DenseMeta
from paged_jax.model.cpu_weights import CPU_WEIGHTS, ENV, CpuWeight, pack_params
from paged_jax.model.families import causal_lm
from paged_jax.model.init import init_params
from paged_jax.worker.runner import ModelRunner
from pallas_kernels.cpu import gemm

pytestmark = pytest.mark.skipif(not gemm.available(), reason="the CPU GEMM needs a C++ compiler (g++)")


def _logits(config, params, tokens):
    model = causal_lm(config)
    meta = DenseMeta.single(len(tokens))
    hidden, _ = model.apply(params, jnp.asarray(tokens, jnp.int32), meta.positions, None, meta)
    return np.asarray(model.apply(params, hidden, method="compute_logits"))


def _entries(record) -> set[str]:
    flat = jax.tree_util.tree_flatten_with_path(record, is_leaf=lambda x: isinstance(x, CpuWeight))[0]
    return {"/".join(k.key for k in path) for path, _ in flat}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [False, True])
def test_packed_forward_matches_the_parameters(tiny_config, dtype, tied):
    config = dataclasses.replace(tiny_config, dtype=dtype, tie_word_embeddings=tied)
    params = init_params(config, seed=3)
    packed, report = pack_params(params, config)
    layer_weights = {"self_attn/qkv_proj", "self_attn/o_proj", "mlp/gate_up_proj", "mlp/down_proj"}
    want = {f"layers_{i}/{w}" for i in range(config.num_layers) for w in layer_weights} | {"lm_head"}
    assert _entries(packed[CPU_WEIGHTS]) == want and report.weights == len(want)
    assert "qkv_proj" not in packed["params"]["layers_0"]["self_attn"]  # replaced, not duplicated
    assert ("lm_head" in packed["params"]) is False and "embed_tokens" in packed["params"]
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 11)
    ref, got = _logits(config, params, tokens), _logits(config, packed, tokens)
    scale = np.abs(ref).max()
    if dtype == "float32":
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * scale)
    else:  # the same products, summed in another order, each projection rounded to bfloat16 once
        np.testing.assert_allclose(got, ref, rtol=0, atol=0.03 * scale)
        assert np.mean(np.argmax(got, -1) == np.argmax(ref, -1)) >= 0.8


def test_quantized_weights_stay_on_xla_dots(tiny_config, tiny_params):
    params = quant.quantize_params(tiny_params, "int8", lm_head=False)
    packed, report = pack_params(params, tiny_config)
    assert _entries(packed[CPU_WEIGHTS]) == {"lm_head"}  # the float LM head only
    assert isinstance(packed["params"]["layers_0"]["mlp"]["down_proj"], quant.QuantizedWeight)
    tokens = np.arange(5)
    np.testing.assert_allclose(
        _logits(tiny_config, packed, tokens), _logits(tiny_config, params, tokens), rtol=0, atol=1e-4
    )


def _runner(config, params) -> ModelRunner:
    return ModelRunner(
        config, params, num_pages=32, page_size=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32
    )


def test_cpu_runner_packs_and_its_decode_step_calls_the_gemm(tiny_config, tiny_params, monkeypatch):
    runner = _runner(tiny_config, tiny_params)
    assert runner.cpu_pack is not None and runner.cpu_pack.weights == 4 * tiny_config.num_layers + 1
    hlo = step_job(runner, "decode").lower().compile().as_text()
    target = gemm.kernel().target
    assert hlo.count(f'custom_call_target="{target}"') == 4 * tiny_config.num_layers + 1
    assert " dot(" not in hlo  # every weight dot is the GEMM (attention is the CPU kernel's custom call)
    monkeypatch.setenv(ENV, "0")
    plain = _runner(tiny_config, tiny_params)
    assert plain.cpu_pack is None and CPU_WEIGHTS not in plain.params


def test_the_record_names_its_gemm_build(tiny_config, tiny_params):
    """The packed tree's structure carries the GEMM library's cache name, so the runner's executable key (the
    params' fingerprint) changes with the build that the compiled custom calls run."""
    packed, _ = pack_params(tiny_params, tiny_config)
    w = packed[CPU_WEIGHTS]["lm_head"]
    assert w.library == gemm.kernel().library.name
    assert gemm.kernel().library.name in str(jax.tree.structure(packed))


def test_a_packed_runner_asks_for_no_onednn_dots(tiny_config, tiny_params, monkeypatch):
    """oneDNN's dot option (`paged_jax.worker.xla_flags`) only adds compile variants once the GEMM takes every
    weight dot, so a packed runner keeps its forward steps on one set of options."""
    from paged_jax.worker import xla_flags

    monkeypatch.setenv(xla_flags.ONEDNN_ENV, "1")
    config = dataclasses.replace(tiny_config, dtype="bfloat16")
    params = jax.tree.map(lambda w: w.astype(jnp.bfloat16), tiny_params)
    runner = _runner(config, params)
    assert runner.cpu_pack is not None
    assert runner.jobs.forward(xla_flags.ONEDNN_MIN_TOKENS, 4).options == ()
