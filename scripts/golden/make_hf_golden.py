"""Build small random HF models of every supported family and their golden outputs under tests/data/hf_*/.

Run by hand with torch + transformers (not in CI):  /tmp/peer/hf/bin/python scripts/golden/make_hf_golden.py [NAME ...]
(no names: every variant).

Each variant directory holds `config.json`, safetensors weights (one file, or shards with
`model.safetensors.index.json`) and `golden.npz` with, per prompt i: `prompt_i` [n] int32,
`logits_i` [n, vocab] float32 (HF eager attention, float32) and `greedy_i` [16] int32 (HF greedy
`generate`, EOS disabled); an embedding variant (`embed`) also `hidden_i` [n, hidden] float32, the final
hidden states after the final norm, and the sentence-transformers files of its pooling. Weights are re-drawn
with a larger std than HF's init so that logits are
peaked and greedy argmaxes are far from ties; norms and biases are randomised so they matter.

The family variants (Qwen3, Gemma 2/3, Mixtral, Qwen3-MoE, Qwen3.5 dense and MoE) are smaller (vocab 288,
just above the byte tokenizer's 259, hidden 32) and store their weights in bfloat16: values are rounded to
bfloat16 before the goldens are computed in float32, so loading them as float32 is exact; 115-305 kB each. Their
windows (4 tokens), soft caps, query scalar, RoPE bases and routing are set so that each feature changes these
prompts' logits.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

OUT = Path(__file__).resolve().parents[2] / "tests" / "data"
NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 11, 23)
BASE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

VARIANTS: dict[str, dict] = {
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),
    "tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "llama3_rope": dict(
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "head_dim128": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, arch="qwen2"),
    "sharded": dict(num_attention_heads=8, num_key_value_heads=2, shard="60KB"),
}
FAMILY_BASE = dict(
    BASE,
    vocab_size=288,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    bf16=True,
)
QWEN3_5 = dict(
    FAMILY_BASE,
    num_hidden_layers=4,
    rms_norm_eps=1e-6,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25),
)
FAMILY_VARIANTS: dict[str, dict] = {
    "qwen3": dict(FAMILY_BASE, arch="qwen3", rms_norm_eps=1e-6),
    "gemma2": dict(
        FAMILY_BASE,
        arch="gemma2",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=12.0,
        rms_norm_eps=1e-6,
    ),
    "gemma3": dict(
        FAMILY_BASE,
        arch="gemma3",
        num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=4,
        query_pre_attn_scalar=24,
        rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e6),
            "sliding_attention": dict(rope_type="default", rope_theta=1e4),
        },
    ),
    "mixtral": dict(FAMILY_BASE, arch="mixtral", intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(
        FAMILY_BASE,
        arch="qwen3_moe",
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        rms_norm_eps=1e-6,
    ),
    # A Qwen3-Embedding-shaped model: sentence-transformers last-token pooling + Normalize, Matryoshka; its golden
    # also holds `hidden_i` [n, hidden] (transformers' last_hidden_state, after the final norm).
    "qwen3_embed": dict(FAMILY_BASE, arch="qwen3", rms_norm_eps=1e-6, embed=True),
    # Qwen3.5: three Gated DeltaNet layers, then one gated full-attention layer; 8 linear value heads
    # over 4 key heads (grouped), conv width 4, partial rotary (a quarter of head_dim).
    # Their seeds are fixed: a random Gated DeltaNet stack is sensitive to float32 rounding (transformers' own float32
    # logits drift from its float64 ones by up to 1.4e-4 on some seeds); these drift by at most 2.4e-5 (dense) and
    # have no near-tied greedy step.
    "qwen3_5": dict(QWEN3_5, arch="qwen3_5", seed=34),
    "qwen3_5_moe": dict(
        QWEN3_5,
        arch="qwen3_5_moe",
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        seed=24,
    ),
}
ARCHES = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma2": "Gemma2",
    "gemma3": "Gemma3Text",
    "mixtral": "Mixtral",
    "qwen3_moe": "Qwen3Moe",
    "qwen3_5": "Qwen3_5Text",
    "qwen3_5_moe": "Qwen3_5MoeText",
}
MODEL_CLASSES = {"gemma3": "Gemma3ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}


def hf_model(arch: str, spec: dict) -> torch.nn.Module:
    """A transformers model of `arch` (key of ARCHES) from config keyword arguments, eager attention."""
    prefix = ARCHES[arch]
    config = getattr(transformers, f"{prefix}Config")(**spec, attn_implementation="eager")
    model_class = MODEL_CLASSES.get(arch, f"{prefix}ForCausalLM")
    return getattr(transformers, model_class)(config)


def build(name: str, spec: dict, seed: int) -> None:
    spec = dict(spec)
    arch, shard, bf16 = spec.pop("arch", "llama"), spec.pop("shard", None), spec.pop("bf16", False)
    embed = spec.pop("embed", False)
    seed = spec.pop("seed", seed)  # a variant may fix its own seed (one whose greedy steps are far from ties)
    torch.manual_seed(seed)
    model = hf_model(arch, spec if bf16 else {**BASE, **spec}).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
            if bf16:  # stored as bfloat16 below: make the float32 model hold exactly those values
                p.copy_(p.to(torch.bfloat16).float())
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    directory = OUT / f"hf_{name}"
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory, max_shard_size=shard or "50MB", safe_serialization=True)
    for extra in ("generation_config.json",):
        (directory / extra).unlink(missing_ok=True)
    if bf16:
        path = directory / "model.safetensors"
        save_file(
            {k: v.to(torch.bfloat16) for k, v in load_file(str(path)).items()}, str(path), metadata={"format": "pt"}
        )

    if embed:
        write_embedding_files(directory)

    rng = np.random.default_rng(seed)
    golden: dict[str, np.ndarray] = {}
    min_gap = np.inf
    for i, n in enumerate(PROMPT_LENGTHS):
        prompt = np.concatenate([[1], rng.integers(3, model.config.vocab_size, n - 1)]).astype(np.int64)
        ids = torch.from_numpy(prompt)[None]
        with torch.no_grad():
            logits = model(ids).logits[0].float().numpy()
            if embed:
                golden[f"hidden_{i}"] = model.model(ids).last_hidden_state[0].float().numpy()
            out = model.generate(
                ids,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                min_new_tokens=0,
                attention_mask=torch.ones_like(ids),
                output_logits=True,
                return_dict_in_generate=True,
            )
        greedy = out.sequences[0, n:].numpy()
        assert len(greedy) == NEW_TOKENS, (name, len(greedy))
        for step_logits in out.logits:
            top2 = np.sort(step_logits[0].float().numpy())[-2:]
            min_gap = min(min_gap, float(top2[1] - top2[0]))
        golden[f"prompt_{i}"] = prompt.astype(np.int32)
        golden[f"logits_{i}"] = logits.astype(np.float32)
        golden[f"greedy_{i}"] = greedy.astype(np.int32)
    np.savez_compressed(directory / "golden.npz", **golden)
    files = sorted(p.name for p in directory.iterdir())
    size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    print(f"{name}: {files} {size / 1e3:.0f} kB, min greedy top-2 logit gap {min_gap:.4f}")


def write_embedding_files(directory: Path) -> None:
    """Qwen3-Embedding's sentence-transformers layout: last-token pooling, then Normalize; Matryoshka config."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (directory / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (directory / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}, indent=2) + "\n")


def main(names: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    every = {**VARIANTS, **FAMILY_VARIANTS}
    for seed, (name, spec) in enumerate(every.items()):
        if not names or name in names:
            build(name, spec, seed)
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "variants": sorted(every)}
    (OUT / "hf_golden_versions.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
