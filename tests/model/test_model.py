"""The Flax model on the tiny config: seam, masking, packing, dtypes, determinism, greedy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.engine.load import load_model
from paged_jax.model.attention import DenseMeta, dense_attention
from paged_jax.model.init import count_params, init_params, param_bytes
from paged_jax.model.llama import LlamaForCausalLM
from paged_jax.model.reference import _greedy, full_logits, greedy_generate


def _forward(config, params, tokens, positions, segments):
    model = LlamaForCausalLM(config)
    meta = DenseMeta(segment_ids=jnp.asarray(segments, jnp.int32), positions=jnp.asarray(positions, jnp.int32))
    hidden, caches = model.apply(params, jnp.asarray(tokens, jnp.int32), meta.positions, None, meta)
    return np.asarray(model.apply(params, hidden, method=LlamaForCausalLM.compute_logits)), caches


def test_init_is_deterministic_in_seed(tiny_config):
    a, b, c = init_params(tiny_config, 0), init_params(tiny_config, 0), init_params(tiny_config, 1)
    leaves_a, leaves_b, leaves_c = (jax.tree_util.tree_leaves(p) for p in (a, b, c))
    assert all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))
    assert not np.array_equal(a["params"]["lm_head"], c["params"]["lm_head"])
    assert count_params(a) == tiny_config.num_params()
    assert param_bytes(a) == 4 * tiny_config.num_params()
    w = np.asarray(a["params"]["layers_0"]["mlp"]["gate_up_proj"])
    assert abs(w.std() - 0.02) < 1e-3 and abs(w.mean()) < 1e-3
    np.testing.assert_array_equal(a["params"]["norm"]["weight"], 1.0)


def test_forward_shapes_and_cache_passthrough(tiny_config, tiny_params):
    logits, caches = _forward(tiny_config, tiny_params, [1, 5, 9], [0, 1, 2], [0, 0, 0])
    assert logits.shape == (3, tiny_config.vocab_size) and logits.dtype == np.float32
    assert caches == [None] * tiny_config.num_layers and np.isfinite(logits).all()


def test_attention_fn_gets_each_layer_cache(tiny_config, tiny_params):
    seen = []

    def counting_attention(q, k, v, kv_cache, meta, *, sm_scale, **layer_options):
        seen.append(kv_cache)
        out, _ = dense_attention(q, k, v, None, meta, sm_scale=sm_scale, **layer_options)
        return out, kv_cache + 100

    model = LlamaForCausalLM(tiny_config, attention_fn=counting_attention)
    meta = DenseMeta.single(4)
    caches_in = [jnp.int32(i) for i in range(tiny_config.num_layers)]
    _, caches = model.apply(tiny_params, jnp.arange(4, dtype=jnp.int32), meta.positions, caches_in, meta)
    assert [int(c) for c in caches] == [100 + i for i in range(tiny_config.num_layers)]
    assert [int(c) for c in seen] == list(range(tiny_config.num_layers))
    with pytest.raises(ValueError, match="kv_caches"):
        model.apply(tiny_params, jnp.arange(4, dtype=jnp.int32), meta.positions, caches_in[:1], meta)


def test_causal_and_padding_do_not_leak(tiny_config, tiny_params):
    base, _ = _forward(tiny_config, tiny_params, [1, 10, 20, 30, 40], range(5), [0] * 5)
    changed, _ = _forward(tiny_config, tiny_params, [1, 10, 20, 99, 41], range(5), [0] * 5)
    np.testing.assert_allclose(base[:3], changed[:3], atol=1e-6)
    assert np.abs(base[3:] - changed[3:]).max() > 1e-4
    padded, _ = _forward(
        tiny_config, tiny_params, [1, 10, 20, 30, 40, 7, 7], [0, 1, 2, 3, 4, 0, 0], [0, 0, 0, 0, 0, -1, -1]
    )
    np.testing.assert_allclose(base, padded[:5], atol=1e-6)


def test_packed_sequences_match_separate_runs(tiny_config, tiny_params):
    seqs = [[1, 4, 8, 15], [1, 200, 3], [1, 77, 78, 79, 80, 81]]
    tokens = [t for s in seqs for t in s]
    positions = [p for s in seqs for p in range(len(s))]
    segments = [i for i, s in enumerate(seqs) for _ in s]
    packed, _ = _forward(tiny_config, tiny_params, tokens, positions, segments)
    start = 0
    for seq in seqs:
        alone, _ = _forward(tiny_config, tiny_params, seq, range(len(seq)), [0] * len(seq))
        np.testing.assert_allclose(packed[start : start + len(seq)], alone, atol=1e-5)
        start += len(seq)


def test_dense_attention_matches_repeat_kv_reference():
    rng = np.random.default_rng(0)
    t, hq, hkv, d = 6, 8, 2, 16
    q, k, v = (rng.standard_normal((t, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
    meta = DenseMeta(
        segment_ids=jnp.asarray([0, 0, 0, 1, 1, -1], jnp.int32), positions=jnp.asarray([0, 1, 2, 0, 1, 0], jnp.int32)
    )
    out, cache = dense_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), "cache", meta, sm_scale=0.25)
    assert cache == "cache"
    kr, vr = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)  # HF repeat_kv
    want = np.zeros_like(q)
    for seg_start, seg_len in ((0, 3), (3, 2)):
        for i in range(seg_len):
            qi = q[seg_start + i]  # [Hq, D]
            ks, vs = kr[seg_start : seg_start + i + 1], vr[seg_start : seg_start + i + 1]
            s = np.einsum("hd,khd->hk", qi, ks) * 0.25
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            want[seg_start + i] = np.einsum("hk,khd->hd", p, vs)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)


def test_bfloat16_forward(tiny_config):
    config = tiny_config.replace(dtype="bfloat16")
    params = init_params(config, 0)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params))
    logits, _ = _forward(config, params, [1, 2, 3], range(3), [0] * 3)
    ref, _ = _forward(tiny_config, init_params(tiny_config, 0), [1, 2, 3], range(3), [0] * 3)
    assert logits.dtype == np.float32 and np.abs(logits - ref).max() < 0.05


def test_tied_embeddings_use_the_embedding(tiny_config):
    config = tiny_config.replace(tie_word_embeddings=True)
    params = init_params(config, 0)
    assert "lm_head" not in params["params"]
    model = LlamaForCausalLM(config)
    hidden = jnp.ones((2, config.hidden_size), jnp.float32)
    logits = model.apply(params, hidden, method=LlamaForCausalLM.compute_logits)
    np.testing.assert_allclose(logits, hidden @ params["params"]["embed_tokens"]["embedding"].T, rtol=1e-5, atol=1e-6)


def test_greedy_generate_matches_argmax_and_compiles_once(tiny_config, tiny_params):
    model = LlamaForCausalLM(tiny_config)
    prompt = [1, 50, 60, 70]
    new = greedy_generate(model, tiny_params, prompt, 5)
    seq = list(prompt)
    for _ in range(5):  # step by step with an unpadded full forward
        logits = full_logits(model, tiny_params, jnp.asarray(seq, jnp.int32), jnp.int32(len(seq)))
        seq.append(int(jnp.argmax(logits[-1])))
    assert new == seq[len(prompt) :]
    before = _greedy._cache_size()
    greedy_generate(model, tiny_params, [1, 9, 9], 5)  # same bucket (16) and steps: no recompile
    assert _greedy._cache_size() == before
    assert greedy_generate(model, tiny_params, prompt, 5, eos=new[1]) == new[: new.index(new[1]) + 1]


def test_load_model_by_config_name():
    config, params, tokenizer = load_model("tiny", dtype="bfloat16", seed=3)
    assert config.name == "tiny" and config.dtype == "bfloat16"
    assert params["params"]["lm_head"].dtype == jnp.bfloat16
    assert tokenizer.decode(tokenizer.encode("hé")) == "hé"
