"""oneDNN dots for bfloat16 forward steps on CPU (`paged_jax.worker.xla_flags`): when the engine applies them,
that they keep the math (logits against a float32 reference, as close as XLA's default dots), and that the
engine compiles its forward steps with them once, without recompiling. These engines run XLA's dots: the CPU
GEMM's weights record is off here (with it the runner never asks for oneDNN: tests/model/test_cpu_weights.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.config.engine import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.model import cpu_weights, quant
from paged_jax.model.attention import DenseMeta
from paged_jax.model.llama import LlamaForCausalLM
from paged_jax.sampling_params import SamplingParams
from paged_jax.tokenization.tokenizer import ByteTokenizer
from paged_jax.worker import xla_flags

ONEDNN_FUSION = '"kind":"__onednn_fusion"'


@pytest.fixture(autouse=True)
def xla_dots(monkeypatch):
    monkeypatch.setenv(cpu_weights.ENV, "0")


def cpu_flags() -> set[str]:
    return set(open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split())


def cpu_has_avx512_bf16() -> bool:
    """XLA hands bfloat16 dots to oneDNN only where the CPU has AVX-512 BF16; elsewhere the option is inert."""
    return "avx512_bf16" in cpu_flags()


def test_when_the_option_applies(monkeypatch):
    use = xla_flags.use_onednn_dots
    assert use(jnp.bfloat16, "cpu", mode="auto", amx=True)
    assert not use(jnp.bfloat16, "cpu", mode="auto", amx=False)
    assert use(jnp.bfloat16, "cpu", mode="1", amx=False)
    assert not use(jnp.bfloat16, "cpu", mode="0", amx=True)
    assert not use(jnp.float32, "cpu", mode="auto", amx=True)  # float32 only when asked for
    assert use(jnp.float32, "cpu", mode="1")
    assert not use(jnp.float16, "cpu", mode="1")
    assert not use(jnp.bfloat16, "tpu", mode="1")
    assert not use("bfloat16", "gpu", mode="1")
    assert xla_flags.forward_compiler_options(False) == ()
    assert dict(xla_flags.forward_compiler_options(True)) == xla_flags.ONEDNN_DOT_OPTIONS
    monkeypatch.setenv(xla_flags.ONEDNN_ENV, "yes")
    with pytest.raises(ValueError, match="PAGED_JAX_ONEDNN"):
        xla_flags.onednn_mode()
    monkeypatch.setenv(xla_flags.ONEDNN_ENV, "0")
    assert not use(jnp.bfloat16, "cpu", amx=True)


def test_amx_is_read_from_the_cpu_flags(tmp_path):
    amx, avx = tmp_path / "amx", tmp_path / "avx"
    amx.write_text("processor : 0\nflags : fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n")
    avx.write_text("processor : 0\nflags : fpu avx2 fma avx512f avx512_bf16\n")
    assert xla_flags.cpu_has_amx(str(amx))
    assert not xla_flags.cpu_has_amx(str(avx))
    assert not xla_flags.cpu_has_amx(str(tmp_path / "missing"))


@pytest.fixture(scope="module")
def bf16_model(tiny_config, tiny_params):
    """The tiny model in bfloat16, and its weights widened back to float32 (the same values) for a reference."""
    config = tiny_config.replace(dtype="bfloat16")
    params = jax.tree.map(lambda w: w.astype(jnp.bfloat16), tiny_params)
    return config, params, jax.tree.map(lambda w: w.astype(jnp.float32), params)


def dense_last_logits(config, params, prompts, onednn: bool) -> tuple[np.ndarray, str]:
    """Last-position logits [len(prompts), V] of the dense model (the step's dots), compiled with or without
    the oneDNN options, and the optimized HLO."""
    tokens = jnp.asarray(np.concatenate(prompts), jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(len(p)) for p in prompts]), jnp.int32)
    segments = jnp.asarray(np.concatenate([np.full(len(p), i) for i, p in enumerate(prompts)]), jnp.int32)
    ends = jnp.asarray(np.cumsum([len(p) for p in prompts]) - 1, jnp.int32)
    lm = LlamaForCausalLM(config)

    def last(params, tokens, positions, segments, ends):
        hidden, _ = lm.apply(params, tokens, positions, None, DenseMeta(segment_ids=segments, positions=positions))
        return lm.apply(params, hidden[ends], round_to_dtype=onednn, method="compute_logits")

    lowered = jax.jit(last).lower(params, tokens, positions, segments, ends)
    compiled = lowered.compile(compiler_options=dict(xla_flags.forward_compiler_options(onednn)))
    return np.asarray(compiled(params, tokens, positions, segments, ends)), compiled.as_text()


def test_onednn_dots_keep_the_math(bf16_model, tiny_config):
    """bfloat16 logits with oneDNN dots (LM head rounded to bfloat16) against the float32 model on the same
    weights: within bfloat16 tolerance, and no further from it than XLA's default bfloat16 dots are."""
    config, params, params32 = bf16_model
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, config.vocab_size, n) for n in (5, 33, 70)]
    want, _ = dense_last_logits(tiny_config, params32, prompts, onednn=False)
    off, hlo_off = dense_last_logits(config, params, prompts, onednn=False)
    on, hlo_on = dense_last_logits(config, params, prompts, onednn=True)
    assert ONEDNN_FUSION not in hlo_off
    if cpu_has_avx512_bf16():
        assert hlo_on.count(ONEDNN_FUSION) >= 4 * config.num_layers  # qkv, o, gate/up, down per layer
    scale = np.abs(want).max()
    err_off, err_on = np.abs(off - want).max() / scale, np.abs(on - want).max() / scale
    assert err_on < 3e-2, (err_on, err_off)  # bfloat16: 8 mantissa bits, through 2 layers and the LM head
    assert err_on <= 2 * err_off + 4e-3, (err_on, err_off)
    assert (np.argmax(on, -1) == np.argmax(want, -1)).all()
    # float32 with oneDNN's float32 GEMMs (PAGED_JAX_ONEDNN=1): the float32 logits up to summation order.
    on32, hlo32 = dense_last_logits(tiny_config, params32, prompts, onednn=True)
    if "avx512f" in cpu_flags():  # seen fused there; not checked on AVX2-only CPUs
        assert ONEDNN_FUSION in hlo32
    np.testing.assert_allclose(on32, want, rtol=0, atol=1e-5 * scale)
    assert (np.argmax(on32, -1) == np.argmax(want, -1)).all()


def generate(engine: LLMEngine, prompts: list[list[int]], sp: SamplingParams, tag: str) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, sp)
    outs = {}
    while engine.has_unfinished():
        outs |= {o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished}
    return [outs[f"{tag}{i}"] for i in range(len(prompts))]


def test_engine_compiles_bf16_steps_with_onednn_once(bf16_model, monkeypatch):
    """With the option on, a bfloat16 engine's forward executables of >= ONEDNN_MIN_TOKENS tokens are keyed by
    and compiled with it (oneDNN fusions in their HLO on AVX-512 BF16 CPUs), smaller ones not; a float32
    engine's too under this setting, but not under ``auto``; never a model's with int8 weights. A second run
    of the same shapes compiles nothing."""
    config, params, _ = bf16_model
    monkeypatch.setenv(xla_flags.ONEDNN_ENV, "1")
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_pages=64, warmup=False)
    engine = LLMEngine(config, params, ByteTokenizer(), cfg)
    rng = np.random.default_rng(5)
    lengths = (7, 40, 90)  # prefill steps of 64 tokens (oneDNN), decode steps of 16 (XLA's dots)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)
    first = generate(engine, [rng.integers(3, 259, n).tolist() for n in lengths], sp, "a")
    compiled = engine.runner.compile_stats.count
    again = generate(engine, [rng.integers(3, 259, n).tolist() for n in lengths], sp, "b")  # same shapes
    assert all(len(t) == 6 for t in first + again)
    assert engine.runner.compile_stats.count == compiled
    on = xla_flags.forward_compiler_options(True)
    small, large = engine.runner.jobs.forward(16, 8), engine.runner.jobs.forward(xla_flags.ONEDNN_MIN_TOKENS, 8)
    assert small.options == () and large.options == on and on in large.key and small.key != large.key
    if cpu_has_avx512_bf16():
        hlo = {job: engine.runner._executable(job).as_text() for job in (small, large)}
        assert ONEDNN_FUSION in hlo[large] and ONEDNN_FUSION not in hlo[small]

    def options(engine: LLMEngine) -> tuple:
        return engine.runner.jobs.forward(64, 8).options

    assert options(engine) == on
    assert options(LLMEngine(config, quant.quantize_params(params, "int8"), ByteTokenizer(), cfg)) == ()
    params32 = jax.tree.map(lambda w: w.astype(jnp.float32), params)
    assert options(LLMEngine(config.replace(dtype="float32"), params32, ByteTokenizer(), cfg)) == on  # asked for
    monkeypatch.setenv(xla_flags.ONEDNN_ENV, "auto")
    assert options(LLMEngine(config.replace(dtype="float32"), params32, ByteTokenizer(), cfg)) == ()
