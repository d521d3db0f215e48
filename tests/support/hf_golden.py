"""The small random Hugging Face models under tests/data/hf_* and their golden outputs from transformers (made by
scripts/golden/make_hf_golden.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "data"


def load_golden(directory: Path) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per prompt: its token ids [n] int32, transformers' float32 logits [n, vocab] and greedy continuation [16]."""
    data = np.load(directory / "golden.npz")
    count = len([k for k in data.files if k.startswith("prompt_")])
    return [(data[f"prompt_{i}"], data[f"logits_{i}"], data[f"greedy_{i}"]) for i in range(count)]
