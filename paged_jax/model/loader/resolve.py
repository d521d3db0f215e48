"""Which model a `--model` string names: a path, a real model shipped by name, a Hugging Face id found in the
local hub cache, or an architecture config (random weights) — or a one-line `ConfigError` saying which of
these it is not, with close names that prefer real models.

The order, first match wins:
1. an existing path (HF directory, GGUF file, orbax checkpoint, config JSON);
2. a named real model (`named.NAMED_MODELS`, e.g. `smollm2-135m-instruct`);
3. an architecture config under `configs/` (`tiny`, `llama-3.2-1b`: random weights from a seed);
4. `ORG/NAME`: the snapshot of the local Hugging Face hub cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
   `$XDG_CACHE_HOME/huggingface/hub` or `~/.cache/huggingface/hub`), `models--ORG--NAME/snapshots/<rev>/`
   with `<rev>` from `refs/main` (else the newest snapshot). Nothing is downloaded: a missing id says how
   to fetch it.
A string that looks like a path (a separator, `~`, `.`, a known suffix) but does not exist says so; any other
string is an unknown name.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from paged_jax.config import ConfigError, available_configs
from paged_jax.model.loader.named import NAMED_MODELS

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")  # ORG/NAME, as the hub spells them
PATH_SUFFIXES = (".gguf", ".json", ".safetensors")


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What a `--model` string resolved to.

    `path`: the file or directory holding the model (None for a config name); `kind`: "path", "named",
    "hub" or "config"; `name`: the name to serve it under by default (the hub id for a hub snapshot, whose
    directory is named by a commit hash)."""

    spec: str
    kind: str
    path: Path | None
    name: str | None = None

    @property
    def random_weights(self) -> bool:
        """Weights drawn from a seed: a config name, or a config JSON file given by path."""
        return self.kind == "config" or (self.path is not None and self.path.is_file() and self.path.suffix == ".json")

    @property
    def load_as(self) -> str | Path:
        """What the loaders take: the path, else the config name."""
        return self.path if self.path is not None else self.spec


def hub_cache_dir() -> Path:
    """The local Hugging Face hub cache, found the way `huggingface_hub` finds it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def hub_snapshot(model_id: str, cache: Path | None = None) -> Path | None:
    """The cached snapshot directory of `model_id` (ORG/NAME), or None when the cache has none."""
    repo = (cache or hub_cache_dir()) / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        pinned = snapshots / ref.read_text().strip()
        if pinned.is_dir():
            return pinned
    candidates = [p for p in snapshots.iterdir() if p.is_dir()]
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def cached_hub_models(cache: Path | None = None) -> list[str]:
    """The ORG/NAME ids of the cache's model repositories that hold a snapshot."""
    root = cache or hub_cache_dir()
    if not root.is_dir():
        return []
    ids = []
    for repo in sorted(root.glob("models--*--*")):
        model_id = repo.name.removeprefix("models--").replace("--", "/", 1)
        if hub_snapshot(model_id, root) is not None:
            ids.append(model_id)
    return ids


def real_models() -> list[str]:
    """Models with trained weights known by name here: the shipped named models and the hub cache's."""
    return [*NAMED_MODELS, *cached_hub_models()]


def resolve_model(spec: str | Path) -> ModelSource:
    """The model `spec` names (see the module docstring); ConfigError with one line when it names none."""
    text = str(spec)
    path = Path(text).expanduser()
    if text and path.exists():
        return ModelSource(text, "path", path)
    if text in NAMED_MODELS:
        try:
            return ModelSource(text, "named", NAMED_MODELS[text].path(), text)
        except FileNotFoundError as e:
            raise ConfigError(f"model: {e}") from None
    if text in available_configs():
        return ModelSource(text, "config", None, text)
    if HUB_ID.match(text) and not text.endswith(PATH_SUFFIXES):
        snapshot = hub_snapshot(text)
        if snapshot is not None:
            return ModelSource(text, "hub", snapshot, text)
        raise ConfigError(
            f"model: {text!r} is neither a local directory nor in the Hugging Face cache ({hub_cache_dir()})"
            f"{_did_you_mean(text)}; "
            f"paged-jax does not download: fetch it with `huggingface-cli download {text}`, then pass the id "
            "or its directory"
        )
    if _looks_like_path(text):
        raise ConfigError(f"model: {text}: no such file or directory{_near_paths(path)}")
    raise ConfigError(f"model: unknown model {text!r}{_did_you_mean(text)}; {_catalogue()}")


def _looks_like_path(text: str) -> bool:
    return os.sep in text or text.startswith(("~", ".")) or text.endswith(PATH_SUFFIXES) or not text


def _near_paths(path: Path) -> str:
    """ " (did you mean ...?)" with existing siblings whose names are close to the missing one."""
    parent = path.parent
    if not parent.is_dir():
        return f" ({parent} does not exist either)" if str(parent) not in ("", ".") else ""
    try:
        names = [p.name for p in parent.iterdir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=3, cutoff=0.6)
    return f" (did you mean {_or(str(parent / n) for n in close)}?)" if close else ""


def _did_you_mean(text: str) -> str:
    """Close names, real models first; a config is marked as random weights."""
    real = difflib.get_close_matches(text, real_models(), n=3, cutoff=0.6)
    configs = difflib.get_close_matches(text, available_configs(), n=3, cutoff=0.6)
    close = [*real, *(f"{c} (random weights)" for c in configs if c not in real)][:3]
    return f" (did you mean {_or(close)}?)" if close else ""


def _catalogue() -> str:
    real = ", ".join(real_models()) or "none installed"
    return (
        f"real models: {real}; random-weight configs: {', '.join(available_configs())}; "
        "or a path (HF directory, GGUF file, orbax checkpoint) or a Hugging Face id in the local cache"
    )


def _or(items) -> str:
    items = [repr(i) if " " not in i else f"'{i.split(' ', 1)[0]}' {i.split(' ', 1)[1]}" for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


__all__ = ["ModelSource", "cached_hub_models", "hub_cache_dir", "hub_snapshot", "real_models", "resolve_model"]
