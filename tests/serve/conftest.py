"""Fixtures of the CLI tests: a local Hugging Face hub cache laid out as `huggingface_hub` writes it."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"
HF_GQA = DATA / "hf_gqa"  # a 2-layer Llama in HF format (config.json + model.safetensors)


def write_hub_model(cache: Path, model_id: str, source: Path, revision: str = "0123abcd" * 5) -> Path:
    """`source`'s files as the hub cache holds a download of `model_id`: content-addressed `blobs/`, a
    `snapshots/<revision>/` of relative links to them, and `refs/main` naming the revision. Returns the snapshot."""
    repo = cache / ("models--" + model_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / revision
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(source.iterdir()):
        if f.suffix not in (".json", ".safetensors", ".jinja"):
            continue
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Callable[..., Path]:
    """A fresh hub cache under `$HF_HOME/hub`; `hub_cache(model_id, cache=None, revision=...)` stores
    tests/data/hf_gqa under that id (in `cache` instead when given) and returns its snapshot."""
    home = tmp_path / "hf-home"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    (home / "hub").mkdir(parents=True)

    def add(model_id: str, cache: Path | None = None, **kwargs) -> Path:
        return write_hub_model(cache or home / "hub", model_id, HF_GQA, **kwargs)

    return add
