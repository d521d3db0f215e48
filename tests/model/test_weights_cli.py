"""`paged-jax convert` and `paged-jax info` end to end on the small HF golden directory."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from paged_jax.engine.load import load_model
from serve.main import COMMANDS, main

GQA = Path(__file__).parents[1] / "data" / "hf_gqa"


def test_convert_then_load_checkpoint(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["convert", "--hf", str(GQA), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert "110,912 parameters" in capsys.readouterr().out
    config, params, _ = load_model(str(out))
    hf_config, hf_params, _ = load_model(GQA, dtype="bfloat16")
    assert config == hf_config
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(hf_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert main(["info", "--model", str(out)]) == 0
    assert "memory: 221,824 bytes" in capsys.readouterr().out


def test_info_on_config_name(capsys):
    assert main(["info", "--model", "tiny", "--dtype", "bfloat16"]) == 0
    text = capsys.readouterr().out
    assert "parameters: 1,344,768" in text and "memory: 2,689,536 bytes" in text


def test_subcommands_are_registered():
    assert {"convert", "info"} <= set(COMMANDS)
    with pytest.raises(SystemExit):
        main(["convert", "--hf", str(GQA)])  # --out is required


def test_convert_gguf_writes_checkpoint_and_tokenizer(tmp_path, capsys, monkeypatch):
    """A GGUF file converts to an orbax checkpoint with the same parameters (this file has no vocabulary, so no
    tokenizer files; tests/model/test_smollm2.py converts one that has)."""
    import gguf

    from tests.model.test_gguf_import import write_gguf

    monkeypatch.setenv("PAGED_JAX_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf", GQA, qtype=gguf.GGMLQuantizationType.Q8_0)
    assert gguf.GGUFReader(str(path)).get_field("tokenizer.ggml.model") is None  # no vocabulary in this file
    out = tmp_path / "ckpt"
    assert main(["convert", "--gguf", str(path), "--out", str(out)]) == 0
    assert "110,912 parameters" in capsys.readouterr().out
    config, params, _ = load_model(str(out))
    want_config, want_params, _ = load_model(path)
    assert config == want_config and not (out / "tokenizer.json").exists()
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(SystemExit):
        main(["convert", "--hf", str(GQA), "--gguf", str(path), "--out", str(out)])  # one source only
