"""Tokenizers: a byte-level one for the embedded `tiny` config, and the model's own `tokenizer.json`.

Both satisfy the `Tokenizer` protocol the engine uses. Text becomes ids exactly as the model's tokenizer
makes them: `encode(text, add_special_tokens=True)` lets the tokenizer's post-processor decide whether a
BOS (or anything else) belongs in front, as transformers and vLLM do; we never prepend one by hand.
Decoding skips special tokens by default (`skip_special_tokens`, `spaces_between_special_tokens` as in vLLM).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from paged_jax.config import ModelConfig
from paged_jax.config.model_files import MAX_JSON_BYTES, ModelFileError, model_file, read_text
from paged_jax.tokenization.chat_template import ChatTemplate, load_chat_template
from paged_jax.tokenization.special_tokens import SpecialTokens, resolve_special_tokens

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    special: SpecialTokens
    chat_template: ChatTemplate | None
    # ids whose text can still change with the tokens after them (byte-fallback pieces), see Detokenizer
    open_ended_ids: frozenset[int]
    special_ids: frozenset[int]  # the ids `skip_special_tokens` leaves out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str: ...


@dataclass
class ByteTokenizer:
    """UTF-8 bytes as tokens: 0 pad, 1 BOS, 2 EOS, byte b -> 3 + b; ids >= 259 are unused (vocab 320).

    `encode(text, add_special_tokens=True)` puts BOS in front, like a SentencePiece model's post-processor.
    """

    vocab_size: int = 320
    pad_token_id: int = 0
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    offset: int = 3
    chat_template: ChatTemplate | None = None
    special: SpecialTokens = field(init=False)
    open_ended_ids: frozenset[int] = frozenset()
    special_ids: frozenset[int] = frozenset()  # none has text: every special is always skipped

    def __post_init__(self) -> None:
        if self.vocab_size < self.offset + 256:
            raise ValueError(f"vocab_size: a byte tokenizer needs at least {self.offset + 256}, got {self.vocab_size}")
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        self.special = SpecialTokens(
            bos_token_id=self.bos_token_id,
            eos_token_id=eos,
            pad_token_id=self.pad_token_id,
            eos_token_ids=tuple(self.eos_token_ids),
            sources=dict.fromkeys(("bos", "eos", "pad"), "byte tokenizer"),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.offset + b for b in text.encode("utf-8")]
        return ([self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []) + ids

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        """Bytes to text; the special and unused ids have no text, whatever `skip_special_tokens` says."""
        data = bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < self.offset + 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` with the model's special tokens and chat template.

    Build one from a model directory with `HFTokenizer.from_dir`, or from a `tokenizers.Tokenizer` made
    elsewhere (e.g. from GGUF metadata) with the constructor.
    """

    def __init__(
        self, tokenizer, special: SpecialTokens, chat_template: ChatTemplate | None = None, name: str = "tokenizer.json"
    ) -> None:
        self._tok = tokenizer
        self.name = name
        self.special = special
        self.chat_template = chat_template
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = special.bos_token_id
        self.eos_token_ids: tuple[int, ...] = special.eos_token_ids
        added = tokenizer.get_added_tokens_decoder()
        self._added: dict[int, str] = {int(i): t.content for i, t in added.items()}
        self.special_ids: frozenset[int] = frozenset(int(i) for i, t in added.items() if t.special)
        self.open_ended_ids: frozenset[int] = _byte_fallback_ids(tokenizer)

    @classmethod
    def from_dir(
        cls, model_dir: str | Path, fallback: ModelConfig | None = None, chat_template_file: str | Path | None = None
    ) -> HFTokenizer:
        """`tokenizer.json` of `model_dir`, its special tokens (`paged_jax.tokenization.special_tokens`) and chat
        template.

        `fallback` (usually the model config) fills BOS/EOS ids no file names; `chat_template_file`
        overrides the directory's template.
        """
        from tokenizers import Tokenizer as _HFTok

        model_dir = Path(model_dir)
        path = model_file(model_dir, "tokenizer.json")
        if path is None:
            raise ModelFileError(f"tokenizer.json: missing from {model_dir}")
        try:
            tok = _HFTok.from_str(read_text(path, MAX_JSON_BYTES))
        except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
            if isinstance(e, ModelFileError):
                raise
            raise ModelFileError(f"tokenizer.json: not a tokenizer the tokenizers library can read ({e})") from None
        special = resolve_special_tokens(
            model_dir,
            tok.token_to_id,
            fallback.bos_token_id if fallback is not None else None,
            tuple(fallback.eos_token_ids) if fallback is not None else (),
        )
        return cls(tok, special, load_chat_template(model_dir, chat_template_file), name=str(model_dir))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids the model's tokenizer gives, its post-processor adding special tokens when asked."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        """Text of `ids`. With `spaces_between_special_tokens` (the default) this is the tokenizer's own decode,
        as transformers and vLLM return it. False keeps every added token exactly as written, next to the text
        of its neighbours: each run of ordinary tokens is decoded alone (vLLM's behaviour for that setting)."""
        ids = [int(i) for i in ids]
        if spaces_between_special_tokens or not self._added:
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            content = self._added.get(i)
            if content is None:
                run.append(i)
                continue
            if skip_special_tokens and i in self.special_ids:
                continue
            if run:
                parts.append(self._tok.decode(run, skip_special_tokens=skip_special_tokens))
                run = []
            parts.append(content)
        if run:
            parts.append(self._tok.decode(run, skip_special_tokens=skip_special_tokens))
        return "".join(parts)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def to_json(self) -> str:
        """The `tokenizers` JSON of this tokenizer (what grammar backends build their token trie from)."""
        return self._tok.to_str()

    def describe(self) -> str:
        """One line for `paged-jax info`: model type and what the post-processor adds."""
        data = json.loads(self._tok.to_str())
        kind = (data.get("model") or {}).get("type", "?")
        bos_added = self.encode("a")[:1] != self.encode("a", add_special_tokens=False)[:1]
        return (
            f"{self.name} ({kind}, vocab {self.vocab_size}, {len(self._added)} added tokens; "
            f"post-processor {'adds' if bos_added else 'adds no'} BOS)"
        )


def _byte_fallback_ids(tok) -> frozenset[int]:
    """Ids of `<0xNN>` pieces when the decoder uses byte fallback: their text depends on the bytes after them."""
    decoder = json.dumps(json.loads(tok.to_str()).get("decoder"))
    if "ByteFallback" not in decoder:
        return frozenset()
    return frozenset(i for t, i in tok.get_vocab(with_added_tokens=False).items() if _BYTE_TOKEN.fullmatch(t))


def load_tokenizer(
    model_dir: str | Path | None, config: ModelConfig, chat_template_file: str | Path | None = None
) -> Tokenizer:
    """`tokenizer.json` of `model_dir` when present, else a `ByteTokenizer` sized to the config."""
    if model_dir is not None and model_file(model_dir, "tokenizer.json") is not None:
        return HFTokenizer.from_dir(model_dir, fallback=config, chat_template_file=chat_template_file)
    bos = config.bos_token_id if config.bos_token_id is not None else 1
    eos = tuple(config.eos_token_ids) or (2,)
    template = load_chat_template(None, chat_template_file) if chat_template_file is not None else None
    return ByteTokenizer(vocab_size=config.vocab_size, bos_token_id=bos, eos_token_ids=eos, chat_template=template)


__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]
