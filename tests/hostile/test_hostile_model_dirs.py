"""Hostile model directories: only regular files inside the directory are read, and JSON is read with a cap.

Before: `config.json`, `generation_config.json` or `tokenizer.json` linked to /dev/zero read until out of
memory; a FIFO `tokenizer.json` hung loading forever; `model.safetensors` (single file or glob) linked to
a file outside the directory was loaded. The Hugging Face hub cache layout (snapshot files linking into
the repository's `blobs/`) still loads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from paged_jax.config import ConfigError, load_model_config
from paged_jax.config.generation_defaults import load_generation_defaults
from paged_jax.config.model_files import ModelFileError, read_json
from paged_jax.model.loader.hf import load_hf_params, safetensors_files
from paged_jax.tokenization.chat_template import load_chat_template
from paged_jax.tokenization.tokenizer import HFTokenizer, load_tokenizer

DATA = Path(__file__).parents[1] / "data"
GQA = DATA / "hf_gqa"


def _model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(GQA, d)
    return d


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"])
def test_link_to_dev_zero_is_refused(tmp_path: Path, name: str) -> None:
    d = _model_dir(tmp_path)
    (d / name).unlink(missing_ok=True)
    (d / name).symlink_to("/dev/zero")
    config = load_model_config(GQA)
    loaders = {
        "config.json": lambda: load_model_config(d),
        "generation_config.json": lambda: load_generation_defaults(d),
        "tokenizer.json": lambda: load_tokenizer(d, config),
        "chat_template.jinja": lambda: load_chat_template(d),
    }
    with pytest.raises(ValueError, match=rf"{name}: .*(outside the model directory|not a regular file)"):
        loaders[name]()


def test_fifo_tokenizer_does_not_hang(tmp_path: Path) -> None:
    """Run in a child process: the old code blocked in open() inside the tokenizers library, GIL held."""
    d = _model_dir(tmp_path)
    os.mkfifo(d / "tokenizer.json")
    code = (
        "import sys; from paged_jax.tokenization.tokenizer import HFTokenizer\n"
        "try:\n    HFTokenizer.from_dir(sys.argv[1])\nexcept ValueError as e:\n    print(e)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "JAX_PLATFORMS": "cpu"}
    try:
        done = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("loading a FIFO tokenizer.json blocked")
    assert "tokenizer.json: not a regular file" in done.stdout, done.stderr


@pytest.mark.parametrize("name", ["model.safetensors", "weights-00001.safetensors"])
def test_safetensors_link_out_of_the_directory_is_refused(tmp_path: Path, name: str) -> None:
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(GQA / "model.safetensors", outside)
    d = _model_dir(tmp_path)
    (d / "model.safetensors").unlink()
    (d / name).symlink_to(outside)  # single-file path, then the glob path
    with pytest.raises(ModelFileError, match=rf"^{name}: links to .* outside the model directory"):
        load_hf_params(d, load_model_config(d))


def test_special_safetensors_file_is_refused(tmp_path: Path) -> None:
    d = _model_dir(tmp_path)
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")
    with pytest.raises(ModelFileError, match="^model.safetensors: not a regular file"):
        safetensors_files(d)


def test_hub_cache_layout_still_loads(tmp_path: Path, real_tokenizer_dir) -> None:
    """<cache>/models--x/snapshots/<rev>/FILE -> ../../blobs/<hash>, as huggingface_hub writes it."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for i, f in enumerate([*GQA.iterdir(), real_tokenizer_dir("gpt-2") / "tokenizer.json"]):
        shutil.copy(f, repo / "blobs" / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    config = load_model_config(snapshot)
    assert load_hf_params(snapshot, config)
    assert load_tokenizer(snapshot, config).encode("hello")


def test_unreadable_tokenizer_json_is_a_clean_error(tmp_path: Path) -> None:
    d = _model_dir(tmp_path)
    (d / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ModelFileError, match="^tokenizer.json: not a tokenizer"):
        HFTokenizer.from_dir(d)


def test_in_directory_links_are_fine(tmp_path: Path) -> None:
    d = _model_dir(tmp_path)
    (d / "real.json").write_text((d / "config.json").read_text())
    (d / "config.json").unlink()
    (d / "config.json").symlink_to("real.json")
    assert load_model_config(d).vocab_size == load_model_config(GQA).vocab_size


def test_json_reads_are_capped_and_bounded(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_text("[" + "0," * 600 + "0]")
    with pytest.raises(ModelFileError, match="^big.json: larger than"):
        read_json(big, limit=1000)
    deep = tmp_path / "config.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ModelFileError, match="nested too deeply"):
        read_json(deep)
    with pytest.raises(ConfigError, match="config.json: .*nested too deeply"):
        load_model_config(tmp_path)


@pytest.mark.parametrize(
    "break_it,needle",
    [
        (lambda d: (d / "config.json").write_text('{"hidden_size": "wide"}'), "config.json"),
        (lambda d: (d / "config.json").write_text("{not json"), "config.json: not valid JSON"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"{}"), "model.safetensors: not a"),
    ],
    ids=["config-field", "config-json", "safetensors-header"],
)
def test_cli_prints_one_clean_error_line(tmp_path: Path, capsys, break_it, needle: str) -> None:
    """Issue 25.14: config and safetensors errors reached users as raw tracebacks."""
    from serve.main import main

    d = _model_dir(tmp_path)
    break_it(d)
    assert main(["info", "--model", str(d)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("paged-jax info: error: ") and needle in err and "\n" not in err, err
