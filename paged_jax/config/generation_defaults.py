"""Sampling defaults from a model's `generation_config.json`, for the fields a request leaves unset.

vLLM does the same by default (`--generation-config auto`): a model that ships `temperature: 0.6, top_p: 0.9`
is sampled that way unless the request says otherwise. Read: `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty` and `max_new_tokens` (as `max_tokens`). Like vLLM, `do_sample` is not read.
`--generation-config none` turns the defaults off; `--generation-config DIR` reads another directory's file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from paged_jax.config.model_files import read_json_object
from paged_jax.sampling_params import SamplingParams

FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_generation_defaults(model: str | Path | None, setting: str = "auto") -> dict[str, Any]:
    """The SamplingParams fields `generation_config.json` sets; {} with `setting` "none" or no such file.

    `setting`: "auto" (the model directory's file), "none", or a directory holding a generation_config.json.
    Raises ValueError naming the file's field when a value is invalid.
    """
    if setting == "none":
        return {}
    folder = Path(model) if setting == "auto" and model is not None else Path(setting) if setting != "auto" else None
    if folder is None or not folder.is_dir():
        if setting not in ("auto", "none"):
            raise ValueError(f"generation_config: {setting} is not a directory")
        return {}
    config = read_json_object(folder, "generation_config.json")
    defaults = {ours: config[hf] for hf, ours in FIELDS.items() if config.get(hf) is not None}
    inverse = {ours: hf for hf, ours in FIELDS.items()}
    try:
        SamplingParams(**defaults).validate()
    except ValueError as e:
        field = str(e).split(":", 1)[0]
        raise ValueError(
            f"generation_config.json: {inverse.get(field, field)}: {str(e).split(':', 1)[-1].strip()}"
        ) from None
    return defaults


def sampling_params(defaults: Mapping[str, Any], **explicit: Any) -> SamplingParams:
    """SamplingParams from the fields a request set, the model's defaults filling the rest."""
    return SamplingParams(**{**defaults, **explicit})


__all__ = ["FIELDS", "load_generation_defaults", "sampling_params"]
