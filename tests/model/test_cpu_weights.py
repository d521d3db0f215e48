"""The CPU-weights record (paged_jax.model.cpu_weights): projections packed once for the CPU GEMM, read by the
model in place of its parameters. Packed and plain forwards agree on random weights (float32 to rounding,
bfloat16 within its rounding), the record holds exactly the projections and the LM head (tied: packed from the
embedding, which stays), w8a8 weights are packed as int8 and give XLA's w8a8 results bit for bit, weight-only
quantized weights stay on XLA's dots, and the CPU runner packs by default and calls the GEMM for every projection
of its compiled decode step."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.engine.aot import step_job
from paged_jax.model import cpu_weights, quant
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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "block,name,shape,contract",
    [
        ("self_attn", "qkv_proj", (48, 3, 5, 16), 1),
        ("self_attn", "o_proj", (4, 16, 40), 2),
        ("mlp", "gate_up_proj", (64, 2, 96), 1),
    ],
)
def test_w8a8_dot_is_xlas_bit_for_bit(dtype, block, name, shape, contract):
    """One w8a8 projection (QKV-, o- and gate/up-shaped), packed, against XLA's w8a8 dot (`quant.dot`) on random
    activations: the int32 sums are exact on both, the quantization and rescale are one code, so the same bits."""
    rng = np.random.default_rng(len(shape) + contract)
    w = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    qw = quant.quantize_weight(w, contract, "w8a8", native_dot=True)
    packed, _ = pack_params({"params": {"layers_0": {block: {name: qw}}}}, _one_layer())
    cw = packed[CPU_WEIGHTS]["layers_0"][block][name]
    assert cw.packed.dtype == jnp.int8 and cw.scale is qw.scale
    x = jnp.asarray(rng.standard_normal((7, *shape[:contract])) * 3, dtype)
    x = x.at[2].set(0)  # a zero token: its scale is 1, its row zeros
    for out in (None, jnp.float32):
        want = jax.jit(lambda x, o=out: quant.dot(x, qw, contract, o))(x)
        got = jax.jit(lambda x, o=out: quant.dot(x, cw, contract, o))(x)
        assert got.dtype == want.dtype and got.shape == want.shape == (7, *shape[contract:])
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _one_layer():  # what pack_params reads of a config
    return types.SimpleNamespace(num_layers=1, tie_word_embeddings=False)


@pytest.mark.parametrize("tied", [False, True])
def test_w8a8_weights_are_packed_and_the_forward_is_xlas(tiny_config, tied):
    """Every w8a8 projection packed, and the packed forward's logits XLA's (bit for bit with an untied head).
    Up to ~10 s under load: two forwards of the tiny model compile (packed and XLA's) for each case."""
    config = dataclasses.replace(tiny_config, tie_word_embeddings=tied)
    params = quant.quantize_params(init_params(config, seed=5), "w8a8")
    packed, report = pack_params(params, config)
    layer_weights = {"self_attn/qkv_proj", "self_attn/o_proj", "mlp/gate_up_proj", "mlp/down_proj"}
    want = {f"layers_{i}/{w}" for i in range(config.num_layers) for w in layer_weights} | {"lm_head"}
    assert _entries(packed[CPU_WEIGHTS]) == want and report.weights == len(want)
    head = packed[CPU_WEIGHTS]["lm_head"]
    assert (head.scale is None) == tied  # a tied head is the float embedding's; an untied one is w8a8 too
    assert "down_proj" not in packed["params"]["layers_0"]["mlp"]  # the int8 values replaced, not duplicated
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, 9)
    got, want = _logits(config, packed, tokens), _logits(config, params, tokens)
    if tied:  # the float head: the GEMM's float32 sums in another order than XLA's
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    else:
        np.testing.assert_array_equal(got, want)


def test_w8a8_runner_calls_the_int8_gemm(tiny_config, tiny_params):
    params = quant.quantize_params(tiny_params, "w8a8")
    runner = _runner(tiny_config, params)
    assert runner.cpu_pack is not None and runner.cpu_pack.weights == 4 * tiny_config.num_layers + 1
    hlo = step_job(runner, "decode").lower().compile().as_text()
    assert hlo.count(f'custom_call_target="{gemm.kernel().int8_target}"') == 4 * tiny_config.num_layers + (
        0 if tiny_config.tie_word_embeddings else 1
    )
    assert " dot(" not in hlo


def test_weight_only_int8_and_over_long_k_stay_on_xla_dots():
    assert not cpu_weights._packable(quant.quantize_weight(jnp.ones((8, 4)), 1, "int8", native_dot=False))
    assert cpu_weights._packable(quant.quantize_weight(jnp.ones((8, 4)), 1, "w8a8", native_dot=True))
    long_k = quant.QuantizedWeight(
        jax.ShapeDtypeStruct((gemm.MAX_INT8_K + 1, 4), jnp.int8), jnp.ones(4), native_dot=True
    )
    assert not cpu_weights._packable(long_k)


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
