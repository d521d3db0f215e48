"""Qwen3, Gemma 2, Gemma 3, Mixtral and Qwen3-MoE against Hugging Face transformers on small random models
(tests/data/hf_<family>, made by scripts/golden/make_hf_golden.py): float32 logits within 1e-4 and identical greedy
continuations, from the dense model (unrolled; Gemma 2/3 scanned as well, in groups of their window pattern) and
through `LLM.generate` (scanned decoder, paged KV, chunked prefill, prefix caching)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.config import ConfigError, load_model_config
from paged_jax.config.hf import from_hf_config
from paged_jax.engine.load import load_model
from paged_jax.model.attention import DenseMeta
from paged_jax.model.families import causal_lm
from paged_jax.model.reference import greedy_generate
from paged_jax.model.scan import stack_layers
from paged_jax.offline.llm import LLM
from paged_jax.sampling_params import SamplingParams

from support.hf_golden import DATA, load_golden

FAMILIES = ("qwen3", "gemma2", "gemma3", "mixtral", "qwen3_moe")
ATOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    directory = DATA / f"hf_{request.param}"
    config, params, _ = load_model(directory, dtype="float32")
    return request.param, config, params, load_golden(directory)


def packed_logits(config, params, golden, scan: bool = False) -> np.ndarray:
    """All prompts in one flat batch (as the engine runs them) through the dense model: logits [sum n, V];
    `scan`: the scanned decoder, over `params` stacked."""
    model = causal_lm(config, scan_layers=scan)
    params = stack_layers(params) if scan else params
    tokens = np.concatenate([p for p, _, _ in golden])
    positions = np.concatenate([np.arange(len(p)) for p, _, _ in golden])
    segments = np.concatenate([np.full(len(p), i) for i, (p, _, _) in enumerate(golden)])
    meta = DenseMeta(segment_ids=jnp.asarray(segments, jnp.int32), positions=jnp.asarray(positions, jnp.int32))
    hidden, _ = model.apply(params, jnp.asarray(tokens, jnp.int32), meta.positions, None, meta)
    return np.asarray(model.apply(params, hidden, method="compute_logits"))


def test_each_variant_is_the_family_it_claims():
    c = {name: load_model_config(DATA / f"hf_{name}") for name in FAMILIES}
    assert {name: cfg.model_type for name, cfg in c.items()} == {
        "qwen3": "qwen3",
        "gemma2": "gemma2",
        "gemma3": "gemma3",
        "mixtral": "mixtral",
        "qwen3_moe": "qwen3_moe",
    }
    assert c["qwen3"].head_dim * c["qwen3"].num_heads != c["qwen3"].hidden_size  # head_dim set independently
    g2, g3 = c["gemma2"], c["gemma3"]
    assert [g2.layer_sliding_window(i) for i in range(2)] == [4, None]
    assert [g3.layer_sliding_window(i) for i in range(3)] == [4, 4, None]
    assert g2.attn_logit_softcap == 2.0 and g2.final_logit_softcap == 12.0 and g2.attn_scale == 24**-0.5
    assert g3.rope_local_theta == 1e4 and g3.rope_theta == 1e6 and g3.rope_scaling.rope_type == "linear"
    assert c["mixtral"].num_experts == 4 and c["mixtral"].num_experts_per_tok == 2 and c["mixtral"].norm_topk_prob
    assert c["qwen3_moe"].num_experts == 4 and not c["qwen3_moe"].norm_topk_prob


def test_logits_match_hf(family):
    name, config, params, golden = family
    err = np.abs(packed_logits(config, params, golden) - np.concatenate([g for _, g, _ in golden])).max()
    print(f"{name}: max |logit - HF| = {err:.2e}")
    assert err < ATOL, f"{name}: max abs logit error {err}"


def test_greedy_matches_hf(family):
    name, config, params, golden = family
    model = causal_lm(config)
    for prompt, _, greedy in golden:
        assert greedy_generate(model, params, prompt.tolist(), len(greedy), pad_to=64) == greedy.tolist(), name


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_scanned_gemma_matches_hf(name):
    """The scanned Gemmas (one scan step = one period of sliding and global layers) give the golden logits and
    greedy continuations."""
    directory = DATA / f"hf_{name}"
    config, params, _ = load_model(directory, dtype="float32")
    golden = load_golden(directory)
    err = np.abs(packed_logits(config, params, golden, scan=True) - np.concatenate([g for _, g, _ in golden])).max()
    assert err < ATOL, f"{name} scanned: max abs logit error {err}"
    model, stacked = causal_lm(config, scan_layers=True), stack_layers(params)
    for prompt, _, greedy in golden:
        assert greedy_generate(model, stacked, prompt.tolist(), len(greedy), pad_to=64) == greedy.tolist(), name


def test_engine_generate_matches_hf(family):
    """LLM.generate (scanned) over paged KV in pages of 8 (windows of 4 cross page boundaries), prompts chunked
    into 8-token pieces, then the same prompts again, served from the prefix cache."""
    name, _, _, golden = family
    llm = LLM(
        str(DATA / f"hf_{name}"),
        dtype="float32",
        attention_backend="xla",
        page_size=8,
        num_pages=64,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        chunk_size=8,
        warmup=False,
        scan_layers="on",
    )
    assert llm.engine.runner.scan
    prompts = [{"prompt_token_ids": p.tolist()} for p, _, _ in golden]
    params = SamplingParams(temperature=0.0, max_tokens=len(golden[0][2]), ignore_eos=True)
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == [g.tolist() for _, _, g in golden], name
    assert llm.engine.kv.stats().prefix_hits > 0


FEATURES = [  # (variant, config change that removes one feature): the golden logits must then be missed
    ("gemma2", {"sliding_window": None}),
    ("gemma2", {"attn_logit_softcap": None}),
    ("gemma2", {"final_logit_softcap": None}),
    ("gemma2", {"query_pre_attn_scalar": None}),
    ("gemma3", {"rope_local_theta": None}),
    ("gemma3", {"rope_scaling": None}),
    ("gemma3", {"sliding_window_pattern": 0}),
    ("qwen3_moe", {"norm_topk_prob": True}),
]


@pytest.mark.parametrize("name, change", FEATURES, ids=[f"{n}-{next(iter(c))}" for n, c in FEATURES])
def test_each_feature_is_exercised(name, change):
    directory = DATA / f"hf_{name}"
    config, params, _ = load_model(directory, dtype="float32")
    golden = load_golden(directory)
    logits = packed_logits(config.replace(**change), params, golden)
    assert np.abs(logits - np.concatenate([g for _, g, _ in golden])).max() > 1e-2


def test_hf_import_dispatches_on_model_type():
    for name in FAMILIES:
        hf = json.loads((DATA / f"hf_{name}" / "config.json").read_text())
        assert from_hf_config(hf).model_type == load_model_config(DATA / f"hf_{name}").model_type
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(ConfigError, match="^model_type: 'gpt_oss' is not a supported model type"):
        from_hf_config({**base, "model_type": "gpt_oss"})
    with pytest.raises(ConfigError, match="^model_type: 'gemma3' is the multimodal"):
        from_hf_config({**base, "model_type": "gemma3"})
    with pytest.raises(ConfigError, match="^layer_types"):
        from_hf_config(
            {
                **base,
                "model_type": "gemma2",
                "hidden_activation": "gelu_pytorch_tanh",
                "layer_types": ["full_attention", "sliding_attention"],
                "sliding_window": 4,
            }
        )
    with pytest.raises(ConfigError, match="^decoder_sparse_step"):
        from_hf_config(
            {
                **base,
                "model_type": "qwen3_moe",
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 16,
                "mlp_only_layers": [1],
            }
        )


# Published sizes (model cards): Qwen3-8B 8.2B (6.95B without embeddings); Gemma-2-9B 9,241,705,984 (its
# safetensors); Gemma 3 4B 4.3B with its 0.42B SigLIP vision tower, so 3.88B for the text decoder; Mixtral-8x7B
# 46.7B total, 12.9B active; Qwen3-30B-A3B 30.5B total, 3.3B active. The exact values below are also what
# transformers' own modules count for these configs (instantiated on the meta device).
SHIPPED = {
    "qwen3-8b": (8_190_735_360, 8_190_735_360),
    "gemma-2-9b": (9_241_705_984, 9_241_705_984),
    "gemma-3-4b": (3_880_263_168, 3_880_263_168),
    "mixtral-8x7b": (46_702_792_704, 12_879_925_248),
    "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_have_the_published_parameter_counts(name):
    from jax.tree_util import tree_leaves

    from paged_jax.model.init import param_shapes

    config = load_model_config(name)
    assert (config.num_params(), config.num_active_params()) == SHIPPED[name]
    # the formula is the tree the model builds (traced abstractly: no memory)
    assert sum(int(np.prod(x.shape)) for x in tree_leaves(param_shapes(config))) == config.num_params()


def test_info_prints_each_family_without_allocating(capsys):
    from serve.main import main

    outs = {}
    for name, (total, _) in SHIPPED.items():
        assert main(["info", "--model", name, "--no-weights"]) == 0
        outs[name] = capsys.readouterr().out
        assert f"parameters: {total:,}" in outs[name] and "shapes only" in outs[name]
    assert "mixtral, 8 experts, top 2 (12,879,925,248 parameters active per token)" in outs["mixtral-8x7b"]
    assert "sliding window 4096 on 1 of every 2 layers" in outs["gemma-2-9b"]
    assert "attention soft cap 50, final soft cap 30" in outs["gemma-2-9b"]


@pytest.mark.parametrize("name", ["gemma3", "qwen3_moe"])
def test_orbax_checkpoint_round_trips_the_family(tmp_path, name):
    import jax

    from paged_jax.model.loader.checkpoint import load_checkpoint, save_checkpoint

    config, params, _ = load_model(DATA / f"hf_{name}", dtype="float32")
    save_checkpoint(tmp_path / "ckpt", config, params)
    got_config, got = load_checkpoint(tmp_path / "ckpt")
    assert got_config == config
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), got, params))


@pytest.mark.slow  # the TPU kernel in interpret mode
def test_gemma2_windows_and_soft_cap_through_the_pallas_tpu_kernel():
    """The golden variants' head_dim 16 is below the Pallas kernels' 64, so a random Gemma 2 with head_dim 64
    (window 8 on layer 0, soft caps 1 and 5) runs the engine on the TPU kernel (interpret mode) against the
    dense reference."""
    import jax

    from paged_jax.config import ModelConfig
    from paged_jax.config.engine import EngineConfig
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.model.init import init_params
    from paged_jax.tokenization.tokenizer import ByteTokenizer

    config = ModelConfig(
        name="g2",
        model_type="gemma2",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        sliding_window=8,
        sliding_window_pattern=2,
        query_pre_attn_scalar=48,
        attn_logit_softcap=1.0,
        final_logit_softcap=5.0,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        eos_token_ids=(2,),
    )
    params = jax.tree.map(lambda x: x * 8 if x.ndim > 1 else x, init_params(config, seed=1))  # peaked logits
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 259, n).tolist() for n in (11, 19)]  # both longer than the window
    want = [greedy_generate(causal_lm(config), params, p, 4, pad_to=32) for p in prompts]
    ec = EngineConfig(
        num_pages=32,
        page_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        chunk_size=8,
        attention_backend="pallas-interpret",
        warmup=False,
    )
    engine = LLMEngine(config, params, ByteTokenizer(), ec)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
    assert [done["r0"], done["r1"]] == want
