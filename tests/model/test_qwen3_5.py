"""Qwen3.5 dense and MoE (Gated DeltaNet + gated full attention) against Hugging Face transformers on small random
models (tests/data/hf_qwen3_5, hf_qwen3_5_moe, made by scripts/golden/make_hf_golden.py): float32 logits within
1e-4 and identical greedy continuations from the dense (unrolled) model, the layers' linear-attention rule in its
chunked form and in its recurrent form alike; each family feature changes the logits; the HF config maps onto
ours and the engine refuses the family with a clear error."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.config import ConfigError, load_model_config
from paged_jax.config.hf import from_hf_config
from paged_jax.engine.load import load_model
from paged_jax.model import gated_deltanet
from paged_jax.model.attention import DenseMeta
from paged_jax.model.families import causal_lm
from paged_jax.model.reference import greedy_generate
from pallas_kernels.gated_delta import recurrent_gated_delta_rule

from support.hf_golden import DATA, load_golden

VARIANTS = ("qwen3_5", "qwen3_5_moe")
ATOL = 1e-4


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request):
    directory = DATA / f"hf_{request.param}"
    config, params, _ = load_model(directory, dtype="float32")
    return request.param, config, params, load_golden(directory)


def packed_logits(config, params, golden) -> np.ndarray:
    """All prompts in one flat batch through the dense model: logits [sum n, V]."""
    model = causal_lm(config)
    tokens = np.concatenate([p for p, _, _ in golden])
    positions = np.concatenate([np.arange(len(p)) for p, _, _ in golden])
    segments = np.concatenate([np.full(len(p), i) for i, (p, _, _) in enumerate(golden)])
    meta = DenseMeta(segment_ids=jnp.asarray(segments, jnp.int32), positions=jnp.asarray(positions, jnp.int32))
    hidden, _ = model.apply(params, jnp.asarray(tokens, jnp.int32), meta.positions, None, meta)
    return np.asarray(model.apply(params, hidden, method="compute_logits"))


def golden_logits(golden) -> np.ndarray:
    return np.concatenate([g for _, g, _ in golden])


def test_variants_are_the_hybrid_layout():
    for name in VARIANTS:
        c = load_model_config(DATA / f"hf_{name}")
        assert c.model_type == name
        assert [c.is_linear_layer(i) for i in range(c.num_layers)] == [True, True, True, False]
        assert c.rotary_dim == 4 and c.linear_num_value_heads == 2 * c.linear_num_key_heads
        assert c.num_kv_layers == 1
    moe = load_model_config(DATA / "hf_qwen3_5_moe")
    assert moe.num_experts == 4 and moe.norm_topk_prob and moe.shared_expert_intermediate_size == 48


def test_logits_match_hf(variant):
    name, config, params, golden = variant
    err = np.abs(packed_logits(config, params, golden) - golden_logits(golden)).max()
    print(f"{name}: max |logit - HF| = {err:.2e}")
    assert err < ATOL, f"{name}: max abs logit error {err}"


def test_recurrent_form_gives_the_same_logits(variant, monkeypatch):
    """The layers run with the token-by-token rule instead of the chunked one: the same logits (HF's too)."""
    name, config, params, golden = variant
    chunked = packed_logits(config, params, golden)

    def recurrent(q, k, v, g, beta, seg, chunk_size):
        return recurrent_gated_delta_rule(q, k, v, g, beta, seg)

    monkeypatch.setattr(gated_deltanet, "chunked_gated_delta_rule", recurrent)
    rec = packed_logits(config, params, golden)
    assert np.abs(rec - chunked).max() < ATOL
    assert np.abs(rec - golden_logits(golden)).max() < ATOL


def test_greedy_matches_hf(variant):
    name, config, params, golden = variant
    model = causal_lm(config)
    for prompt, _, greedy in golden:
        assert greedy_generate(model, params, prompt.tolist(), len(greedy), pad_to=64) == greedy.tolist(), name


@pytest.mark.parametrize("name", VARIANTS)
def test_partial_rotary_is_exercised(name):
    """RoPE over the whole head instead of its first quarter misses the golden logits."""
    directory = DATA / f"hf_{name}"
    config, params, _ = load_model(directory, dtype="float32")
    golden = load_golden(directory)
    logits = packed_logits(config.replace(partial_rotary_factor=1.0), params, golden)
    assert np.abs(logits - golden_logits(golden)).max() > 1e-2


def test_hf_config_mapping_and_refusals():
    for name in VARIANTS:
        hf = json.loads((DATA / f"hf_{name}" / "config.json").read_text())
        assert from_hf_config(hf).model_type == name
    hf = json.loads((DATA / "hf_qwen3_5" / "config.json").read_text())
    with pytest.raises(ConfigError, match="^model_type: 'qwen3_5' is the multimodal Qwen3.5"):
        from_hf_config({**hf, "model_type": "qwen3_5"})
    with pytest.raises(ConfigError, match="^layer_types"):
        types = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
        from_hf_config({**hf, "layer_types": types})
    with pytest.raises(ConfigError, match="^linear_num_value_heads"):
        from_hf_config({**hf, "linear_num_value_heads": 6})
    with pytest.raises(ConfigError, match="^linear_conv_kernel_dim: missing"):
        from_hf_config({k: v for k, v in hf.items() if k != "linear_conv_kernel_dim"})
    with pytest.raises(ConfigError, match="^full_attention_interval: only the linear-attention hybrids"):
        load_model_config(DATA / "hf_qwen3").replace(full_attention_interval=4)


def test_the_paged_engine_refuses_the_family_by_name():
    from paged_jax.offline.llm import LLM

    with pytest.raises(ConfigError, match="^model_type: 'qwen3_5' .* not served by the paged engine yet"):
        LLM(str(DATA / "hf_qwen3_5"), dtype="float32", num_pages=16, page_size=8, warmup=False)


def test_parameter_count_is_the_tree_the_model_builds():
    from jax.tree_util import tree_leaves

    from paged_jax.model.init import param_shapes

    for name in VARIANTS:
        config = load_model_config(DATA / f"hf_{name}")
        assert sum(int(np.prod(x.shape)) for x in tree_leaves(param_shapes(config))) == config.num_params()
