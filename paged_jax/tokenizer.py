"""Tokenizers: a byte-level one for the embedded `tiny` config, and HF `tokenizer.json` files.

Both satisfy the `Tokenizer` protocol the engine uses: `encode(text, add_bos)`, `decode(ids)`,
`vocab_size`, `bos_token_id`, `eos_token_ids`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from paged_jax.config import ModelConfig


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens: 0 pad, 1 BOS, 2 EOS, byte b -> 3 + b; ids >= 259 are unused (vocab 320)."""

    vocab_size: int = 320
    pad_token_id: int = 0
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    offset: int = 3

    def __post_init__(self) -> None:
        if self.vocab_size < self.offset + 256:
            raise ValueError(f"vocab_size: a byte tokenizer needs at least {self.offset + 256}, got {self.vocab_size}")

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [self.offset + b for b in text.encode("utf-8")]
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < self.offset + 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` through the `tokenizers` library.

    BOS/EOS come from `tokenizer_config.json` (token strings), then `generation_config.json` and
    `config.json` (ids); `fallback` (usually the model config) fills what none of them gives.
    """

    def __init__(self, model_dir: str | Path, fallback: ModelConfig | None = None) -> None:
        from tokenizers import Tokenizer as _HFTok

        model_dir = Path(model_dir)
        self._tok = _HFTok.from_file(str(model_dir / "tokenizer.json"))
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        bos, eos = _special_ids(model_dir, self._tok)
        if bos is None and fallback is not None:
            bos = fallback.bos_token_id
        if not eos and fallback is not None:
            eos = tuple(fallback.eos_token_ids)
        self.bos_token_id: int | None = bos
        self.eos_token_ids: tuple[int, ...] = eos

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def _special_ids(model_dir: Path, tok: Any) -> tuple[int | None, tuple[int, ...]]:
    """(bos id, eos ids) from the model directory's tokenizer/generation/model configs."""
    tc = _read_json(model_dir / "tokenizer_config.json")

    def token_id(entry: Any) -> int | None:
        text = entry.get("content") if isinstance(entry, dict) else entry
        return tok.token_to_id(text) if isinstance(text, str) else None

    bos = token_id(tc.get("bos_token"))
    eos_one = token_id(tc.get("eos_token"))
    eos = (eos_one,) if eos_one is not None else ()
    for name in ("generation_config.json", "config.json"):
        cfg = _read_json(model_dir / name)
        if bos is None and cfg.get("bos_token_id") is not None:
            bos = int(cfg["bos_token_id"])
        more = _as_ids(cfg.get("eos_token_id"))
        eos = eos + tuple(i for i in more if i not in eos)
    return bos, eos


def load_tokenizer(model_dir: str | Path | None, config: ModelConfig) -> Tokenizer:
    """`tokenizer.json` of `model_dir` when present, else a `ByteTokenizer` sized to the config."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").exists():
        return HFTokenizer(model_dir, fallback=config)
    bos = config.bos_token_id if config.bos_token_id is not None else 1
    eos = tuple(config.eos_token_ids) or (2,)
    return ByteTokenizer(vocab_size=config.vocab_size, bos_token_id=bos, eos_token_ids=eos)


__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]
