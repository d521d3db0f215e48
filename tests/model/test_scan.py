"""The scanned decoder (`paged_jax.model.scan`) against the unrolled one: the same weights give the same function.

Dense model: every family (tiny Llama, Qwen3, Mixtral, Qwen3-MoE, Gemma 2 and 3 with their window patterns, and
deeper random Gemmas whose depth is no multiple of the pattern: a remainder group) gives the unrolled logits
within float32 rounding and the same greedy token at every position; scanned Gemmas and scanned LoRA match the
transformers (+ peft) goldens. Engine: scanned and
unrolled engines give identical greedy tokens (and float32 logprobs within rounding) on the C++ CPU backend
with float pages and the XLA backend with int8 pages, with chunked prefill, prefix caching and copy-on-write
forks. The compiled scanned step copies no KV page array (`hlo_audit.kv_copies`). Per-layer checkpoints load
into the stacked tree exactly.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from paged_jax.config import load_model_config
from paged_jax.engine.load import load_model
from paged_jax.model import quant
from paged_jax.model.attention import DenseMeta
from paged_jax.model.families import causal_lm
from paged_jax.model.init import init_params, param_shapes
from paged_jax.model.loader.checkpoint import save_checkpoint
from paged_jax.model.partition import param_partition_specs
from paged_jax.model.scan import (
    LayerGroup,
    head_batched_qkv,
    layer_groups,
    stack_layers,
    stacked_order,
    unstack_layers,
    use_scan,
)
from paged_jax.offline.llm import LLM
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.hlo_audit import kv_copies
from paged_jax.worker.runner import ModelRunner
from pallas_kernels import kv_quant

DATA = Path(__file__).parents[1] / "data"


def _family(name: str):
    if name == "tiny":
        config = load_model_config("tiny").replace(dtype="float32")
        return config, init_params(config, seed=3)
    if name.endswith("_deep"):  # random weights, deeper than the golden variant: 7 layers, pattern 2 or 3
        config = load_model_config(DATA / f"hf_{name.removesuffix('_deep')}").replace(num_layers=7, dtype="float32")
        return config, init_params(config, seed=5)
    config, params, _ = load_model(DATA / f"hf_{name}", dtype="float32")
    return config, params


def _logits(config, params, scan: bool, order=()) -> np.ndarray:
    """Two packed sequences (13 and 7 tokens) through the dense model: logits [20, V] float32."""
    model = causal_lm(config, scan_layers=scan, stacked_order=order)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, config.vocab_size, 20), jnp.int32)
    positions = jnp.asarray(np.r_[np.arange(13), np.arange(7)], jnp.int32)
    meta = DenseMeta(segment_ids=jnp.asarray(np.r_[np.zeros(13), np.ones(7)], jnp.int32), positions=positions)
    hidden, _ = model.apply(params, tokens, positions, None, meta)
    return np.asarray(model.apply(params, hidden, method="compute_logits"))


FAMILIES = ["tiny", "qwen3", "mixtral", "qwen3_moe", "gemma2", "gemma3", "gemma2_deep", "gemma3_deep"]


@pytest.mark.parametrize("name", FAMILIES)
def test_scanned_model_is_the_unrolled_one(name):
    config, params = _family(name)
    got, want = _logits(config, stack_layers(params), True), _logits(config, params, False)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (got.argmax(-1) == want.argmax(-1)).all()  # the same greedy token at every position


@pytest.mark.parametrize("quantization", [None, "int8", "w8a8"])
def test_tpu_stacked_order_is_the_same_model(quantization):
    # TPU stacks gate_up_proj as [L, 2, H, I] and qkv_proj as [L, Hkv, G + 2, H, D] (paged_jax.model.scan's
    # STACKED_ORDERS): the scan step transposes each slice back, so the function is the unrolled one's; int8 values
    # move, their per-channel scales do not. Its QKV matmul is the head-batched form (head_batched_qkv), with
    # int8 x int8 products too (w8a8).
    order = stacked_order("tpu")
    assert order and stacked_order("gpu") == stacked_order("cpu") == ()
    config, params = _family("tiny")
    assert head_batched_qkv(order, config.head_dim) and not head_batched_qkv(stacked_order("gpu"), 128)
    assert not head_batched_qkv(order, 256)  # Gemma's heads: the plain dot (scan.head_batched_qkv says why)
    params = quant.quantize_params(params, quantization)
    stacked = stack_layers(params, order)
    gate_up = stacked["params"]["layers"]["mlp"]["gate_up_proj"]
    values = gate_up.values if quantization else gate_up
    h, i = config.hidden_size, config.intermediate_size
    assert values.shape == (config.num_layers, 2, h, i)
    if quantization:
        assert gate_up.scale.shape == (config.num_layers, 2, i)
    qkv = stacked["params"]["layers"]["self_attn"]["qkv_proj"]
    hkv, g2 = config.num_kv_heads, config.num_heads // config.num_kv_heads + 2
    assert (qkv.values if quantization else qkv).shape == (config.num_layers, hkv, g2, h, config.head_dim)
    got, want = _logits(config, stacked, True, order), _logits(config, params, False)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    back = unstack_layers(stacked, order)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), back, params))
    shapes = param_shapes(config.replace(dtype="float32"), scan_layers=True)  # the model's own init, plain order
    model = causal_lm(config, scan_layers=True, stacked_order=order)
    tokens = jnp.zeros((1,), jnp.int32)
    init = jax.eval_shape(lambda k: model.init(k, tokens, tokens, None, DenseMeta(tokens, tokens)), jax.random.key(0))
    assert init["params"]["layers"]["mlp"]["gate_up_proj"].shape == (config.num_layers, 2, h, i)
    assert shapes["params"]["layers"]["mlp"]["gate_up_proj"].shape == (config.num_layers, h, 2, i)
    # The partition specs are the per-layer ones permuted like their leaves, the layer axis in front.
    specs = param_partition_specs(config, init, order=order)["params"]["layers"]
    assert specs["mlp"]["gate_up_proj"] == P(None, None, None, "tp")
    assert specs["self_attn"]["qkv_proj"] == P(None, "tp", None, None, None)  # Hkv moved in front, sharded still


def test_stacked_tree_is_the_scanned_models_own():
    config = load_model_config("tiny")
    want = param_shapes(config, scan_layers=True)
    got = jax.eval_shape(stack_layers, param_shapes(config))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert jax.tree.leaves(jax.tree.map(lambda a, b: a.shape == b.shape and a.dtype == b.dtype, got, want)) == [
        True
    ] * len(jax.tree.leaves(want))
    assert want["params"]["layers"]["self_attn"]["qkv_proj"].shape[0] == config.num_layers
    params = init_params(config)
    back = unstack_layers(stack_layers(params))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), back, params))


def test_stacked_partition_specs_keep_the_layer_axis_whole():
    config = load_model_config("tiny")
    specs = param_partition_specs(config, param_shapes(config, scan_layers=True))["params"]
    assert specs["layers"]["self_attn"]["qkv_proj"] == P(None, None, "tp", None, None)
    assert specs["layers"]["input_layernorm"]["weight"] == P(None)
    assert specs["embed_tokens"]["embedding"] == P("tp", None)
    q = quant.abstract_params(param_shapes(config, scan_layers=True), ("int8", False, False))
    o_proj = param_partition_specs(config, q)["params"]["layers"]["self_attn"]["o_proj"]
    assert (o_proj.values, o_proj.scale) == (P(None, "tp", None, None), P(None, None))


def test_layer_groups_are_the_window_periods():
    g = LayerGroup
    assert layer_groups(load_model_config("tiny")) == (g(0, 1, 2),)  # uniform: one layer per scan step
    assert layer_groups(load_model_config("gemma-2-9b")) == (g(0, 2, 21),)  # [sliding, global] x 21
    assert layer_groups(load_model_config("gemma-3-4b")) == (g(0, 6, 5), g(30, 1, 4))  # 5 + 1 global, then 4 sliding
    gemma3 = load_model_config(DATA / "hf_gemma3")  # pattern 3
    assert layer_groups(gemma3) == (g(0, 3, 1),)
    assert layer_groups(gemma3.replace(num_layers=7)) == (g(0, 3, 2), g(6, 1, 1))  # a remainder group
    assert layer_groups(gemma3.replace(num_layers=2)) == (g(0, 1, 2),)  # shallower than the pattern: all sliding
    for config in (gemma3.replace(num_layers=n) for n in range(1, 13)):  # every layer once, in order, by its window
        groups = layer_groups(config)
        layers = [
            (x.start + i * x.size + j, x.start + j) for x in groups for i in range(x.count) for j in range(x.size)
        ]
        assert [a for a, _ in layers] == list(range(config.num_layers))
        assert all(config.layer_sliding_window(a) == config.layer_sliding_window(b) for a, b in layers)


def test_which_runners_scan():
    assert use_scan("auto", "tpu") and use_scan("auto", "gpu") and not use_scan("auto", "cpu")
    assert use_scan("on", "cpu") and not use_scan("off", "tpu")
    assert use_scan("auto", "cpu", grouped=True) and not use_scan("off", "cpu", grouped=True)
    with pytest.raises(ValueError, match="^scan_layers: must be one of"):
        use_scan("yes", "cpu")


def _generate(scan: str, backend: str, kv_dtype: str | None):
    llm = LLM(
        "tiny",
        dtype="float32",
        attention_backend=backend,
        kv_dtype=kv_dtype,
        page_size=8,
        num_pages=48,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        chunk_size=16,
        warmup=False,
        scan_layers=scan,
    )
    assert llm.engine.runner.scan == (scan != "off")
    rng = np.random.default_rng(1)
    shared = rng.integers(3, 250, 19).tolist()
    prompts = [{"prompt_token_ids": shared + rng.integers(3, 250, 5 + 4 * i).tolist()} for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    forked = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2)  # copy-on-write of a page
    outs = llm.generate(prompts, greedy, use_tqdm=False) + llm.generate(prompts[:1], forked, use_tqdm=False)
    assert llm.engine.kv.stats().prefix_hits > 0
    tokens = [[list(c.token_ids) for c in o.outputs] for o in outs]
    logprobs = [[lp.logprob for lp in c.logprobs] for o in outs[:3] for c in o.outputs]
    return tokens, np.asarray(logprobs)


@pytest.mark.parametrize("backend, kv_dtype", [("auto", None), ("xla", "int8")])
def test_scanned_engine_is_the_unrolled_one(backend, kv_dtype):
    tokens, logprobs = _generate("on", backend, kv_dtype)
    want_tokens, want_logprobs = _generate("off", backend, kv_dtype)
    assert tokens == want_tokens
    np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend, kv_dtype", [("auto", None), ("xla", "int8")])
def test_scanned_step_copies_no_kv(tiny_config, tiny_params, backend, kv_dtype):
    runner = ModelRunner(
        tiny_config,
        tiny_params,
        num_pages=32,
        page_size=16,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        attention_backend=backend,
        kv_dtype=kv_dtype,
        scan_layers="on",
    )
    pages = kv_quant.split(runner.kv_caches)[0]
    assert runner.scan and pages.shape[0] == 32 * tiny_config.num_layers  # one stacked cache
    hlo = runner.jobs.forward(64, 8).lower().compile().as_text()
    assert " while(" in hlo  # the layers are one loop
    assert kv_copies(hlo, pages.shape, pages.dtype) == []


def test_per_layer_checkpoint_loads_stacked(tmp_path, tiny_config, tiny_params):
    save_checkpoint(tmp_path / "ckpt", tiny_config, tiny_params)  # the stored form is per layer
    llm = LLM(
        str(tmp_path / "ckpt"), num_pages=16, max_num_seqs=2, max_num_batched_tokens=16, warmup=False, scan_layers="on"
    )
    runner = llm.engine.runner
    assert runner.scan and "layers" in runner.params["params"]
    back = unstack_layers(runner.params)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), back, tiny_params))
