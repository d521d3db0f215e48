"""Exactness against Hugging Face transformers on small random models (tests/data/hf_*, made by
scripts/golden/make_hf_golden.py): float32 logits within 1e-4 and identical greedy continuations."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.engine.load import load_model
from paged_jax.model.attention import DenseMeta
from paged_jax.model.llama import LlamaForCausalLM
from paged_jax.model.reference import greedy_generate

from support.hf_golden import DATA, load_golden

VARIANTS = ("gqa", "mqa", "tied", "llama3_rope", "head_dim128", "qwen2", "sharded")
ATOL = 1e-4


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request):
    directory = DATA / f"hf_{request.param}"
    config, params, _ = load_model(directory, dtype="float32")
    return request.param, config, params, load_golden(directory)


def test_variant_shapes_are_what_they_claim():
    configs = {name: load_model(DATA / f"hf_{name}")[0] for name in VARIANTS}
    assert configs["gqa"].num_heads == 8 and configs["gqa"].num_kv_heads == 2
    assert configs["mqa"].num_kv_heads == 1 and configs["mqa"].num_heads > 1
    assert configs["tied"].tie_word_embeddings and configs["qwen2"].attention_bias
    assert configs["llama3_rope"].rope_scaling is not None and configs["llama3_rope"].rope_theta == 500000.0
    assert configs["head_dim128"].head_dim == 128
    assert (DATA / "hf_sharded" / "model.safetensors.index.json").exists()


def test_logits_match_hf(variant):
    name, config, params, golden = variant
    model = LlamaForCausalLM(config)
    # all prompts packed into one flat batch, as the engine will run them
    tokens = np.concatenate([p for p, _, _ in golden])
    positions = np.concatenate([np.arange(len(p)) for p, _, _ in golden])
    segments = np.concatenate([np.full(len(p), i) for i, (p, _, _) in enumerate(golden)])
    meta = DenseMeta(segment_ids=jnp.asarray(segments, jnp.int32), positions=jnp.asarray(positions, jnp.int32))
    hidden, _ = model.apply(params, jnp.asarray(tokens, jnp.int32), meta.positions, None, meta)
    logits = np.asarray(model.apply(params, hidden, method=LlamaForCausalLM.compute_logits))
    want = np.concatenate([g for _, g, _ in golden])
    err = np.abs(logits - want).max()
    print(f"{name}: max |logit - HF| = {err:.2e}")
    assert err < ATOL, f"{name}: max abs logit error {err}"


def test_greedy_matches_hf(variant):
    name, config, params, golden = variant
    model = LlamaForCausalLM(config)
    for prompt, _, greedy in golden:
        assert greedy_generate(model, params, prompt.tolist(), len(greedy), pad_to=64) == greedy.tolist(), name


def test_llama3_scaling_is_exercised():
    config, params, _ = load_model(DATA / "hf_llama3_rope")
    prompt, want, _ = load_golden(DATA / "hf_llama3_rope")[2]
    plain = LlamaForCausalLM(config.replace(rope_scaling=None))
    meta = DenseMeta.single(len(prompt))
    hidden, _ = plain.apply(params, jnp.asarray(prompt), meta.positions, None, meta)
    logits = np.asarray(plain.apply(params, hidden, method=LlamaForCausalLM.compute_logits))
    assert np.abs(logits - want).max() > 1e-2  # without the scaling the golden logits are missed
