"""Which tokens are BOS, EOS, pad and unk for a model directory, and which ids end generation.

Precedence, first source that names a role wins:

- token strings (`bos_token`, `eos_token`, `pad_token`, `unk_token`): `tokenizer_config.json`, then
  `special_tokens_map.json`. A string becomes an id through the tokenizer's vocabulary (added tokens
  included). These strings are what chat templates see as `bos_token` and `eos_token`.
- ids of a role no string named: `generation_config.json`, then `config.json` (`bos_token_id`,
  `pad_token_id`, `eos_token_id`), then the caller's fallback (usually the model config).
- the EOS set, every id that ends generation: the tokenizer's `eos_token`, then each `eos_token_id` of
  `generation_config.json` (an int or a list, e.g. Llama-3-Instruct's `<|end_of_text|>` and `<|eot_id|>`),
  then `config.json`'s, in that order without repeats.

Nothing here decides whether a prompt starts with BOS: the tokenizer's own post-processor does
(`encode(text, add_special_tokens=True)`). A Qwen2 directory names `<|endoftext|>` as BOS in its configs
while its tokenizer never adds it; `bos_token_id` is then reported but never prepended.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paged_jax.config.model_files import read_json_object

ROLES = ("bos", "eos", "pad", "unk")


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """The resolved special tokens; `sources` says which file each role came from (for `paged-jax info`)."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None  # the tokenizer's own EOS (the first of `eos_token_ids`)
    pad_token_id: int | None = None
    unk_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation
    sources: dict[str, str] = field(default_factory=dict)

    def template_tokens(self) -> dict[str, str]:
        """The token strings a chat template may use (`bos_token`, `eos_token`, ...); unset ones are left out."""
        out = {}
        for role in ROLES:
            value = getattr(self, f"{role}_token")
            if value is not None:
                out[f"{role}_token"] = value
        return out


def token_string(entry: Any) -> str | None:
    """A token as written in tokenizer_config.json: a string or an AddedToken dict with `content`."""
    text = entry.get("content") if isinstance(entry, dict) else entry
    return text if isinstance(text, str) else None


def as_ids(value: Any) -> tuple[int, ...]:
    """An `*_token_id` value (None, an int, or a list of ints) as a tuple."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(int(v) for v in values)


def resolve_special_tokens(
    model_dir: str | Path | None,
    token_to_id: Callable[[str], int | None],
    fallback_bos: int | None = None,
    fallback_eos: tuple[int, ...] = (),
) -> SpecialTokens:
    """Resolve every role from the files of `model_dir` with the precedence of this module's docstring."""
    model_dir = Path(model_dir) if model_dir is not None else None
    files = {
        name: read_json_object(model_dir, name) if model_dir is not None else {}
        for name in ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "config.json")
    }
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for role in ROLES:
        text, tid = None, None
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            text = token_string(files[name].get(f"{role}_token"))
            if text is not None:
                tid = token_to_id(text)
                sources[role] = name
                break
        if tid is None and role != "unk":
            for name in ("generation_config.json", "config.json"):
                ids = as_ids(files[name].get(f"{role}_token_id"))
                if ids:
                    tid = ids[0]
                    sources.setdefault(role, name)
                    break
        values[f"{role}_token"], values[f"{role}_token_id"] = text, tid
    if values["bos_token_id"] is None and fallback_bos is not None:
        values["bos_token_id"] = fallback_bos
        sources["bos"] = "model config"
    eos: list[int] = []
    if values["eos_token"] is not None and values["eos_token_id"] is not None:
        eos.append(values["eos_token_id"])
    for name in ("generation_config.json", "config.json"):
        eos += [i for i in as_ids(files[name].get("eos_token_id")) if i not in eos]
    if not eos:
        eos = list(fallback_eos)
        if eos:
            sources["eos"] = "model config"
    if values["eos_token_id"] is None and eos:
        values["eos_token_id"] = eos[0]
    return SpecialTokens(**values, eos_token_ids=tuple(eos), sources=sources)


__all__ = ["SpecialTokens", "as_ids", "resolve_special_tokens", "token_string"]
