"""The new families under tensor parallelism on 8 CPU devices: MoE experts split inside each expert (Mixtral,
Qwen3-MoE, the latter with KV heads replicated over the mesh), and Gemma 2's windows and soft caps through the
sharded attention. Each TP engine must give the single-device engine's prefill logits and greedy tokens.

Like tests/worker/test_sharding.py, the mesh tests need `XLA_FLAGS=--xla_force_host_platform_device_count=8` before
JAX starts, so a plain run re-runs this file in a child pytest with the flag and `PAGED_JAX_MESH_CHILD=1`.
"""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.config import ModelConfig

from support.mesh_child import CHILD, NUM_DEVICES, run_mesh_child

BASE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=64,
    num_layers=2,
    num_heads=8,
    head_dim=16,
    max_position_embeddings=512,
    eos_token_ids=(2,),
)
CONFIGS = {
    "mixtral": ModelConfig(
        name="moe-mixtral", model_type="mixtral", num_kv_heads=8, num_experts=4, num_experts_per_tok=2, **BASE
    ),
    "qwen3_moe": ModelConfig(
        name="moe-qwen3",
        model_type="qwen3_moe",
        num_kv_heads=2,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        **BASE,
    ),
    "gemma2": ModelConfig(
        name="gemma2-small",
        model_type="gemma2",
        num_kv_heads=4,
        sliding_window=8,
        sliding_window_pattern=2,
        query_pre_attn_scalar=12,
        attn_logit_softcap=1.0,
        final_logit_softcap=5.0,
        tie_word_embeddings=True,
        **BASE,
    ),
}


def prompts(seed: int, n: int = 4, max_len: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 259, int(rng.integers(12, max_len))).tolist() for _ in range(n)]


if not CHILD:

    @pytest.mark.mesh
    def test_mesh_suite():
        """The mesh tests below, in a child pytest with 8 host devices."""
        run_mesh_child(__file__)

else:
    import jax

    from paged_jax.config.engine import EngineConfig
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.model.init import init_params
    from paged_jax.model.reference import full_logits
    from paged_jax.sampling_params import SamplingParams
    from paged_jax.tokenization.tokenizer import ByteTokenizer

    GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def generate(config: ModelConfig, params, tp: int) -> tuple[LLMEngine, list[list[int]]]:
        ec = EngineConfig(
            num_pages=64,
            page_size=8,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            chunk_size=16,
            attention_backend="xla",
            warmup=False,
            tensor_parallel_size=tp,
        )
        engine = LLMEngine(config, params, ByteTokenizer(), ec)
        for i, p in enumerate(prompts(seed=len(config.name))):
            engine.add_request(f"r{i}", p, GREEDY)
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
        return engine, [done[f"r{i}"] for i in range(len(done))]

    def test_eight_devices():
        assert jax.device_count() == NUM_DEVICES

    @pytest.mark.parametrize("family", sorted(CONFIGS))
    def test_tensor_parallel_matches_single_device(family):
        config = CONFIGS[family]
        params = init_params(config, seed=7)
        params = jax.tree.map(lambda x: x * 8 if x.ndim > 1 else x, params)  # peaked logits: no greedy ties
        _, want = generate(config, params, tp=1)
        engine, got = generate(config, params, tp=8)
        assert got == want, family
        if config.is_moe:  # each chip holds an I / 8 slice of every expert
            runner = engine.runner
            gate = runner.params["params"]["layers" if runner.scan else "layers_0"]["mlp"]["experts_gate"]
            assert gate.addressable_shards[0].data.shape == (
                *((config.num_layers,) if runner.scan else ()),  # stacked on a layer axis when scanned
                config.num_experts,
                config.hidden_size,
                config.intermediate_size // NUM_DEVICES,
            )
        # The dense reference with the sharded (and, for qwen3_moe, KV-expanded) parameters gives the same logits.
        from paged_jax.model.families import causal_lm

        tokens = np.asarray(prompts(seed=3, n=1)[0] + [0] * 24, np.int32)[:32]
        ref = full_logits(causal_lm(config), params, tokens, np.int32(20))
        tp_model = causal_lm(engine.runner.config, scan_layers=engine.runner.scan)
        tp_ref = full_logits(tp_model, engine.runner.params, tokens, np.int32(20))
        np.testing.assert_allclose(np.asarray(tp_ref)[:20], np.asarray(ref)[:20], rtol=1e-4, atol=1e-4)
