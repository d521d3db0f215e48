"""How does a second start skip parsing and dequantizing a GGUF file?

Loading a GGUF file costs its header (the vocabulary and merges are ~100k strings: `gguf_bounds.read_header`) and
then, mostly, dequantizing every quantized tensor with numpy and converting it to the model's layout. `load_cached`
keeps the result (the config and the converted parameters, one `.npy` file per leaf, memory-mapped when read) in a
cache directory, so a warm start reads the arrays instead (docs/user/startup.md). An entry's key hashes the file's
path, size and modification time, the load's `dtype` and model name, and the sources of `paged_jax.model` and
`paged_jax.config` (the conversion code): a changed file, option or loader never reads a stale entry. Models whose
converted parameters exceed `MAX_CACHED_BYTES` are not cached (a dequantized 8B model would take 32 GB of disk).
An entry is written to a temporary directory and renamed into place (readers never see half of one); any
failure to read one is logged, and the file is loaded (and the entry rewritten) as if there were none.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.config import ModelConfig
from paged_jax.config.model import config_from_dict
from paged_jax.model.init import Params
from paged_jax.model.loader.gguf import load_gguf
from paged_jax.model.loader.gguf_file import GGUFFile

log = logging.getLogger(__name__)

MAX_CACHED_BYTES = 2 * 2**30
FORMAT = 1
_VOCAB_KEY = "tokenizer.ggml.model"


@dataclass(frozen=True, slots=True)
class CachedGGUF:
    """A GGUF model as `load_cached` returns it: `gguf` is the open file when it was read (None on a hit)."""

    config: ModelConfig
    params: Params
    has_vocab: bool  # the file carries a tokenizer (`tokenizer.ggml.model`)
    gguf: GGUFFile | None


@functools.cache
def _loader_sources() -> str:
    root = Path(__file__).resolve().parents[2]  # paged_jax/
    h = hashlib.sha256()
    for path in sorted([*(root / "model").rglob("*.py"), *(root / "config").rglob("*.py")]):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def entry_dir(cache_dir: Path, path: Path, dtype: str | None, name: str | None) -> Path:
    """Where the converted parameters of `path` loaded with `dtype` and `name` live under `cache_dir`."""
    stat = path.stat()
    parts = (FORMAT, str(path.resolve()), stat.st_size, stat.st_mtime_ns, dtype, name, _loader_sources())
    return cache_dir / f"{path.stem}-{hashlib.sha256(repr(parts).encode()).hexdigest()[:20]}"


def load_cached(path: Path, dtype: str | None, name: str | None, cache_dir: Path | None) -> CachedGGUF:
    """`load_gguf(path, dtype, name)`, read from / written to `cache_dir` (None: no cache)."""
    entry = None if cache_dir is None else entry_dir(cache_dir, path, dtype, name)
    if entry is not None and (entry / "meta.json").exists():
        try:
            return _read(entry)
        except Exception as e:  # noqa: BLE001 - a broken entry means loading the file itself (and rewriting it)
            log.warning(
                "could not read the converted-weights cache entry %s (%s: %s): reading the GGUF file",
                entry,
                type(e).__name__,
                e,
            )
            shutil.rmtree(entry, ignore_errors=True)
    config, params, gguf = load_gguf(path, dtype=dtype, name=name)
    has_vocab = gguf.get(_VOCAB_KEY, None) is not None
    if entry is not None:
        _write(entry, config, params, has_vocab)
    return CachedGGUF(config, params, has_vocab, gguf)


def _read(entry: Path) -> CachedGGUF:
    meta = json.loads((entry / "meta.json").read_text())
    treedef = pickle.loads((entry / "tree.pkl").read_bytes())
    leaves = []
    for i, dtype in enumerate(meta["dtypes"]):
        raw = np.load(entry / f"{i}.npy", mmap_mode="r")
        leaves.append(jnp.asarray(raw.view(jnp.dtype(dtype))))
    config = config_from_dict(meta["config"], str(entry / "meta.json"))
    return CachedGGUF(config, jax.tree.unflatten(treedef, leaves), meta["has_vocab"], None)


def _write(entry: Path, config: ModelConfig, params: Params, has_vocab: bool) -> None:
    leaves, treedef = jax.tree.flatten(params)
    size = sum(x.nbytes for x in leaves)
    if size > MAX_CACHED_BYTES:
        log.info("converted weights not cached: %.1f GiB exceeds %.0f GiB", size / 2**30, MAX_CACHED_BYTES / 2**30)
        return
    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        dtypes = []
        for i, leaf in enumerate(leaves):
            host = np.asarray(leaf)
            dtypes.append(str(host.dtype))
            # bfloat16 and other ml_dtypes as raw bytes of their width (np.save would store them as void)
            np.save(tmp / f"{i}.npy", host.view(np.dtype(f"u{host.dtype.itemsize}")), allow_pickle=False)
        (tmp / "tree.pkl").write_bytes(pickle.dumps(treedef))
        meta = {"config": config.to_dict(), "has_vocab": has_vocab, "dtypes": dtypes}
        (tmp / "meta.json").write_text(json.dumps(meta))  # last: an entry without it is never read
        tmp.replace(entry)
    except OSError as e:
        log.warning("could not write the converted-weights cache entry %s (%s)", entry, e)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    log.info("converted weights cached: %s (%.0f MiB)", entry, size / 2**20)


__all__ = ["MAX_CACHED_BYTES", "CachedGGUF", "entry_dir", "load_cached"]
