"""Qwen3.5 dense and MoE (Gated DeltaNet + gated full attention) against Hugging Face transformers on small random
models (tests/data/hf_qwen3_5, hf_qwen3_5_moe, made by scripts/golden/make_hf_golden.py): float32 logits within
1e-4 and identical greedy continuations from the dense (unrolled) model, the layers' linear-attention rule in its
chunked form and in its recurrent form alike (each platform runs one of them); each family feature changes the
logits; the HF config maps onto ours (the paged engine's serving: tests/engine/test_qwen3_5_engine.py)."""

from __future__ import annotations

import json

import jax
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

from support.hf_golden import DATA, load_golden

VARIANTS = ("qwen3_5", "qwen3_5_moe")
ATOL = 1e-4


FORMS = ("chunked", "recurrent")


def jitted_apply():
    """A new jitted dense model (JAX shares traces between jits of one function, so each form needs its own)."""

    def apply(model, params, tokens, positions, segments):
        meta = DenseMeta(segment_ids=segments, positions=positions)
        hidden, _ = model.apply(params, tokens, positions, None, meta)
        return model.apply(params, hidden, method="compute_logits")

    return jax.jit(apply, static_argnums=0)


# One jitted model per form of the rule: the form is read while tracing, so each keeps its own traces.
APPLY = {form: jitted_apply() for form in FORMS}


def packed_logits(config, params, golden, form: str, monkeypatch) -> np.ndarray:
    """All prompts in one flat batch through the dense model with the rule in `form`: logits [sum n, V]."""
    used = []

    def pick(platform):
        used.append(platform)
        return form

    monkeypatch.setattr(gated_deltanet, "delta_rule_form", pick)
    tokens = np.concatenate([p for p, _, _ in golden])
    positions = np.concatenate([np.arange(len(p)) for p, _, _ in golden])
    segments = np.concatenate([np.full(len(p), i) for i, (p, _, _) in enumerate(golden)])
    args = (jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), jnp.asarray(segments, jnp.int32))
    logits = np.asarray(APPLY[form](causal_lm(config), params, *args))
    monkeypatch.undo()
    assert used, "the layers did not ask delta_rule_form (every call here traces a new config or form)"
    return logits


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request):
    directory = DATA / f"hf_{request.param}"
    config, params, _ = load_model(directory, dtype="float32")
    return request.param, config, params, load_golden(directory)


@pytest.fixture(scope="module")
def logits(variant):
    """The variant's packed logits with each form of the rule."""
    _, config, params, golden = variant
    with pytest.MonkeyPatch.context() as mp:
        return {form: packed_logits(config, params, golden, form, mp) for form in FORMS}


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


@pytest.mark.parametrize("form", FORMS)
def test_logits_match_hf(variant, logits, form):
    """Both forms of the rule (the one each platform runs, `delta_rule_form`) give HF's logits and each other's."""
    name, _, _, golden = variant
    err = np.abs(logits[form] - golden_logits(golden)).max()
    print(f"{name}, {form}: max |logit - HF| = {err:.2e}")
    assert err < ATOL, f"{name}, {form}: max abs logit error {err}"
    assert np.abs(logits["chunked"] - logits["recurrent"]).max() < ATOL


def test_the_form_is_chosen_by_platform():
    assert gated_deltanet.delta_rule_form("cpu") == "recurrent"
    assert gated_deltanet.delta_rule_form("tpu") == "chunked"
    assert gated_deltanet.delta_rule_form("gpu") == "chunked"
    with pytest.raises(ValueError, match="^form: 'scan'"):
        gated_deltanet.gated_delta_rule(
            "scan", *[jnp.zeros((1, 1, 1))] * 3, jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.zeros((1,), jnp.int32)
        )


def test_greedy_matches_hf(variant):
    name, config, params, golden = variant
    model = causal_lm(config)
    for prompt, _, greedy in golden:
        assert greedy_generate(model, params, prompt.tolist(), len(greedy), pad_to=64) == greedy.tolist(), name


@pytest.mark.parametrize("variant", ["qwen3_5"], indirect=True)  # the MoE variant's attention is the same module
def test_partial_rotary_is_exercised(variant, monkeypatch):
    """RoPE over the whole head instead of its first quarter misses the golden logits."""
    name, config, params, golden = variant
    full = packed_logits(config.replace(partial_rotary_factor=1.0), params, golden, "recurrent", monkeypatch)
    assert np.abs(full - golden_logits(golden)).max() > 1e-2, name


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


def test_parameter_count_is_the_tree_the_model_builds():
    from jax.tree_util import tree_leaves

    from paged_jax.model.init import param_shapes

    for name in VARIANTS:
        config = load_model_config(DATA / f"hf_{name}")
        assert sum(int(np.prod(x.shape)) for x in tree_leaves(param_shapes(config))) == config.num_params()
