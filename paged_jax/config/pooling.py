"""Does this model serve embeddings, and how? The model's pooler (`PoolerConfig`), read from its files or set by
`EngineConfig.pooling` (`--pooling`).

A model directory in the sentence-transformers layout names its pooling: `modules.json` lists a Pooling module
(its folder's `config.json` sets `pooling_mode_lasttoken` or `pooling_mode_mean_tokens`) and a `Normalize`
module when its embeddings are L2-normalized (Qwen3-Embedding: last-token pooling, normalized). A model whose
`config.json` says `"is_matryoshka": true` (or lists `matryoshka_dimensions`) allows a request's `dimensions`
(truncation, then renormalization); any other model refuses it. A model without a pooling module is generative:
it serves embeddings only when `--pooling last|mean` says so (as vLLM serves them only with a pooling runner),
then normalized and without `dimensions` unless its config marks it Matryoshka.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from paged_jax.errors import FieldError
from paged_jax.pooling_params import POOLING_TYPES, PoolingParams

_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """The model's pooling: its type and normalization (a request's defaults), and which `dimensions` it allows:
    `matryoshka` False refuses any; `matryoshka_dimensions` (when given) are the only ones allowed."""

    pooling: str = "last"
    normalize: bool = True
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def params(
        self,
        hidden_size: int,
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
    ) -> PoolingParams:
        """A request's validated PoolingParams: what it set, the model's pooling for the rest. FieldError naming
        `dimensions` when the model is not Matryoshka or does not list that size."""
        params = PoolingParams(
            self.pooling if pooling is None else pooling,
            self.normalize if normalize is None else normalize,
            dimensions,
        ).validate(hidden_size)
        if dimensions is not None and dimensions != hidden_size:
            if not self.matryoshka:
                raise FieldError(
                    "dimensions",
                    "this model does not support Matryoshka truncation (it is not marked "
                    "is_matryoshka in its config.json)",
                )
            allowed = self.matryoshka_dimensions
            if allowed is not None and dimensions not in allowed:
                raise FieldError("dimensions", f"{dimensions} is not one of the model's sizes {list(allowed)}")
        return params


def read_pooler(folder: Path | None, pooling: str | None = None) -> PoolerConfig | None:
    """The pooler of the model in `folder` (None: not a directory), with `pooling` ("last" | "mean", the
    `--pooling` override) replacing its type; None when the model has no pooling module and `pooling` is None
    (a generative-only model)."""
    if pooling is not None and pooling not in POOLING_TYPES:
        raise ValueError(f"pooling: must be one of {', '.join(POOLING_TYPES)}, got {pooling!r}")
    own, normalize = _sentence_transformers(folder)
    if own is None and pooling is None:
        return None
    matryoshka, dims = _matryoshka(folder)
    return PoolerConfig(pooling or own or "last", normalize if own is not None else True, matryoshka, dims)


def _sentence_transformers(folder: Path | None) -> tuple[str | None, bool]:
    """(the Pooling module's type or None, whether a Normalize module follows) from `modules.json`."""
    if folder is None or not (folder / "modules.json").is_file():
        return None, False
    modules = json.loads((folder / "modules.json").read_text())
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pool = kinds.get("Pooling")
    if pool is None:
        return None, False
    config = json.loads((folder / str(pool.get("path", "")) / "config.json").read_text())
    mode = next((name for key, name in _MODES.items() if config.get(key)), None)
    if mode is None:
        modes = sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v)
        raise ValueError(f"pooling: the model's pooling {modes} is not supported (only {', '.join(POOLING_TYPES)})")
    return mode, "Normalize" in kinds


def _matryoshka(folder: Path | None) -> tuple[bool, tuple[int, ...] | None]:
    if folder is None or not (folder / "config.json").is_file():
        return False, None
    config = json.loads((folder / "config.json").read_text())
    dims = config.get("matryoshka_dimensions")
    listed = tuple(int(d) for d in dims) if isinstance(dims, list) else None
    return bool(config.get("is_matryoshka")) or listed is not None, listed
