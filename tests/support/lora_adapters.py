"""Random PEFT adapters for tests (written as PEFT writes them), the merged-weights reference, and engines serving
adapters (shared by tests/lora/test_lora.py and tests/lora/test_lora_sharding.py).

`write_adapter` (paged_jax.lora.random_adapter) writes random adapters; `merged_params` folds an adapter into
the fused parameters (W + scaling * A @ B), the reference a LoRA step must equal up to float rounding.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from paged_jax.config import ModelConfig, load_model_config
from paged_jax.config.engine import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.kv_cache.invariants import check_manager_invariants
from paged_jax.lora import LoRARequest
from paged_jax.lora.peft import LoraAdapter
from paged_jax.lora.random_adapter import write_adapter
from paged_jax.model.init import init_params
from paged_jax.sampling_params import SamplingParams
from paged_jax.tokenization.tokenizer import ByteTokenizer


def merged_params(params, config: ModelConfig, adapter: LoraAdapter):
    """`params` (the fused tree, float) with `adapter` merged into its kernels: W + scaling * A @ B."""
    g = config.num_heads // config.num_kv_heads
    s = adapter.scaling
    out = jax.tree.map(np.asarray, params)
    for i, mods in enumerate(adapter.layers):
        layer = out["params"][f"layers_{i}"]
        attn, mlp = layer["self_attn"], layer["mlp"]

        def delta(name: str, mods=mods) -> np.ndarray:
            a, b = mods[name]
            return s * np.tensordot(a, b, axes=1)

        qkv = np.array(attn["qkv_proj"], np.float32)  # [H, Hkv, G + 2, D]
        h, hkv, _, d = qkv.shape
        if "q_proj" in mods:
            qkv[:, :, :g] += delta("q_proj").reshape(h, hkv, g, d)
        for j, name in ((g, "k_proj"), (g + 1, "v_proj")):
            if name in mods:
                qkv[:, :, j] += delta(name)
        attn["qkv_proj"] = qkv.astype(attn["qkv_proj"].dtype)
        if "o_proj" in mods:
            attn["o_proj"] = (attn["o_proj"].astype(np.float32) + delta("o_proj")).astype(attn["o_proj"].dtype)
        gate_up = np.array(mlp.get("gate_up_proj", np.zeros(0)), np.float32)
        for j, name in ((0, "gate_proj"), (1, "up_proj")):
            if name in mods:
                gate_up[:, j] += delta(name)
        if gate_up.size:
            mlp["gate_up_proj"] = gate_up.astype(mlp["gate_up_proj"].dtype)
        if "down_proj" in mods:
            mlp["down_proj"] = (mlp["down_proj"].astype(np.float32) + delta("down_proj")).astype(mlp["down_proj"].dtype)
    return out


# -- engines serving adapters --------------------------------------------------------------------------------

TINY = load_model_config("tiny")
OPTIONS = {
    "num_pages": 96,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "attention_backend": "xla",
    "warmup": False,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)


def make_tiny_adapters(root: Path) -> dict[str, LoRARequest]:
    """Four adapters of the tiny model: every target (rank 4), q/v only (rank 8, rsLoRA), MLP only, o/k only."""
    specs = {
        "all": dict(rank=4, seed=1),
        "qv": dict(rank=8, seed=2, targets=("q_proj", "v_proj"), rslora=True, alpha=16.0),
        "mlp": dict(rank=2, seed=3, targets=("gate_proj", "up_proj", "down_proj")),
        "ok": dict(rank=6, seed=4, targets=("o_proj", "k_proj")),
    }
    return {
        name: LoRARequest(name, i + 1, str(write_adapter(root / name, TINY, **spec)))
        for i, (name, spec) in enumerate(specs.items())
    }


def lora_engine(config: ModelConfig = TINY, params=None, **options) -> LLMEngine:
    """An engine with LoRA on (2 slots, rank 8) over `params` (default: the tiny model's, seed 0)."""
    params = init_params(config, seed=0) if params is None else params
    ec = EngineConfig(**(OPTIONS | {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8} | options))
    return LLMEngine(config, params, ByteTokenizer(), ec)


def prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 259, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def serve(engine: LLMEngine, requests: list[tuple], arrive_every: int = 1) -> dict[str, tuple]:
    """requests: (id, prompt, params, LoRARequest | None), one arriving every `arrive_every` steps. Returns
    id -> (token ids per sample, logprobs per sample, metrics); checks that every page is free at the end."""
    pending, results, step = list(requests), {}, 0
    while pending or engine.has_unfinished():
        if pending and step % arrive_every == 0:
            rid, prompt, params, lora = pending.pop(0)
            engine.add_request(rid, prompt, params, lora_request=lora)
        for out in engine.step():
            if out.finished:
                lps = [[lp.logprob for lp in c.logprobs or []] for c in out.outputs]
                results[out.request_id] = ([c.token_ids for c in out.outputs], lps, out.metrics)
        step += 1
    check_manager_invariants(engine.kv)
    assert engine.kv.stats().pages_in_use == 0
    return results
