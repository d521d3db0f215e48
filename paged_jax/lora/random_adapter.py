"""Random PEFT adapters written as PEFT writes them, for tests and benchmarks (as `model/init.py` makes random
parameters): `write_adapter` draws A and B (PEFT's layout: lora_A [r, in], lora_B [out, r]) with a std that makes
the delta change greedy tokens, and writes `adapter_model.safetensors` and `adapter_config.json`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from paged_jax.config import ModelConfig
from paged_jax.lora.peft import ATTENTION_MODULES, MODULES

_DIMS = {
    "q_proj": lambda c: (c.hidden_size, c.num_heads * c.head_dim),
    "k_proj": lambda c: (c.hidden_size, c.num_kv_heads * c.head_dim),
    "v_proj": lambda c: (c.hidden_size, c.num_kv_heads * c.head_dim),
    "o_proj": lambda c: (c.num_heads * c.head_dim, c.hidden_size),
    "gate_proj": lambda c: (c.hidden_size, c.intermediate_size),
    "up_proj": lambda c: (c.hidden_size, c.intermediate_size),
    "down_proj": lambda c: (c.intermediate_size, c.hidden_size),
}


def write_adapter(
    path: Path,
    config: ModelConfig,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = MODULES,
    seed: int = 0,
    std: float = 0.2,
    rslora: bool = False,
    extra_config: dict | None = None,
) -> Path:
    """A PEFT adapter directory at `path` for a base model of `config`; returns `path`."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(config.num_layers):
        for name in targets:
            block = "self_attn" if name in ATTENTION_MODULES else "mlp"
            fan_in, fan_out = _DIMS[name](config)
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) * std / math.sqrt(fan_in)).astype(
                np.float32
            )
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * std / math.sqrt(rank)).astype(
                np.float32
            )
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "target_modules": list(targets),
        "bias": "none",
        "modules_to_save": None,
        "task_type": "CAUSAL_LM",
    } | (extra_config or {})
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path
