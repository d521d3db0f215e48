"""A GGUF file's tokenizer as a Hugging Face `tokenizers.Tokenizer` (plus its `tokenizer_config.json`).

A GGUF carries no `tokenizer.json`; it stores llama.cpp's description of the vocabulary:
`tokenizer.ggml.model` (`gpt2`: byte-level BPE; `llama`: SentencePiece-style BPE with byte
fallback), `tokens`, `token_type` (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
6 byte), `merges` (BPE) or `scores` (SentencePiece), `pre` (which split regex the merges were
learned with), the special ids, `add_bos_token`/`add_eos_token`, and `tokenizer.chat_template`.

`tokenizer_from_gguf` rebuilds the equivalent `tokenizers` pipeline, following llama.cpp where it
and transformers' GGUF converter differ (llama.cpp is the reference the file was made for):
- control tokens are special added tokens, user-defined ones plain added tokens (matched whole);
- `pre` picks the split: llama.cpp's `smollm`/`starcoder`-style vocabularies split every digit
  apart before GPT-2's regex; `llama3`-style and `qwen2` have their own regexes;
- SentencePiece text gets one `▁` prepended (when `add_space_prefix`) and spaces become `▁`, as
  llama.cpp does; merges missing from the file are recovered from the scores;
- BOS/EOS are added by the post-processor only when the file says so (`add_bos_token`), never
  by the caller.

`GGUFTokenizer.save(dir)` writes `tokenizer.json`, `tokenizer_config.json` (special tokens,
`add_bos_token`, `chat_template`) and `chat_template.jinja`, so the rest of paged-jax loads a GGUF's
tokenizer the way it loads any Hugging Face directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paged_jax.model.loader.gguf_file import GGUFError, GGUFFile

CONTROL, USER_DEFINED = 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> how llama.cpp splits text before BPE (llama-vocab.cpp's regex table):
# "gpt2" = GPT-2's regex; "digits+gpt2" = each digit alone, then GPT-2's regex; else one regex.
PRE_TOKENIZERS: dict[str, str] = {
    "default": "gpt2",
    "gpt-2": "gpt2",
    "gpt2": "gpt2",
    "phi-2": "gpt2",
    "jina-es": "gpt2",
    "jina-de": "gpt2",
    "smollm": "digits+gpt2",
    "starcoder": "digits+gpt2",
    "refact": "digits+gpt2",
    "command-r": "digits+gpt2",
    "codeshell": "digits+gpt2",
    "exaone": "digits+gpt2",
    "minerva-7b": "digits+gpt2",
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "pixtral": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "megrez": _QWEN2_SPLIT,
}


@dataclass
class GGUFTokenizer:
    """A GGUF's tokenizer: the `tokenizers.Tokenizer` and what `tokenizer_config.json` would hold."""

    tokenizer: Any  # tokenizers.Tokenizer
    config: dict[str, Any] = field(default_factory=dict)

    def save(self, directory: str | Path) -> Path:
        """Write `tokenizer.json`, `tokenizer_config.json` and (if any) `chat_template.jinja` into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2, ensure_ascii=False) + "\n")
        if self.config.get("chat_template"):
            (directory / "chat_template.jinja").write_text(self.config["chat_template"])
        return directory


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE tokens are spelled in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best merged-token score first (the order `tokenizers`' SentencePiece extractor uses)."""
    merges: list[tuple[str, str, float]] = []
    for token, index in vocab.items():
        score = scores[index]
        local = [
            (token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _byte_level_model(meta: dict[str, Any]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    alphabet = _bytes_to_unicode()
    letters = set(alphabet.values())
    vocab = {
        (t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(meta["tokens"])
    }
    if "merges" not in meta:
        raise GGUFError("tokenizer.ggml.merges: missing (a gpt2-style vocabulary needs its merges)")
    merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = meta.get("pre", "default") or "default"
    split = PRE_TOKENIZERS.get(pre)
    if split is None:
        raise GGUFError(
            f"tokenizer.ggml.pre: pre-tokenizer {pre!r} is not known (known: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "gpt2":
        tok.pre_tokenizer = byte_level
    elif split == "digits+gpt2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _sentencepiece_model(meta: dict[str, Any]) -> Any:
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    tokens: list[str] = meta["tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if "merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    elif "scores" in meta:
        merges = _merges_from_scores(vocab, [float(s) for s in meta["scores"]])
    else:
        raise GGUFError("tokenizer.ggml.scores: missing (a llama-style vocabulary needs scores or merges)")
    unk_id = meta.get("unk_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", "▁")]
    if meta.get("add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = None
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("add_space_prefix", True):
        decode.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decode)
    return tok


def _metadata(gguf: GGUFFile) -> dict[str, Any]:
    """The tokenizer keys this module reads, with llama.cpp's defaults filled in."""
    g = lambda k, d=None: gguf.get(f"tokenizer.ggml.{k}", d)  # noqa: E731
    model = g("model")
    if model is None:
        raise GGUFError("tokenizer.ggml.model: missing (this GGUF has no tokenizer)")
    meta: dict[str, Any] = {
        "model": model,
        "tokens": list(g("tokens")),
        "pre": g("pre"),
        "token_type": list(g("token_type", [])),
        "add_space_prefix": bool(g("add_space_prefix", model == "llama")),
        # llama.cpp adds BOS for SentencePiece vocabularies that do not say otherwise
        "add_bos": bool(g("add_bos_token", model == "llama")),
        "add_eos": bool(g("add_eos_token", False)),
    }
    for key in ("merges", "scores"):
        if g(key) is not None:
            meta[key] = list(g(key))
    for name in ("bos", "eos", "unk", "pad"):
        value = g(f"{'unknown' if name == 'unk' else 'padding' if name == 'pad' else name}_token_id")
        meta[f"{name}_id"] = int(value) if value is not None else None
    return meta


def _add_special_tokens(tok: Any, meta: dict[str, Any], byte_level: bool) -> None:
    """Control tokens as special added tokens, user-defined ones as plain added tokens (both matched whole)."""
    from tokenizers import AddedToken

    letters = set(_bytes_to_unicode().values()) if byte_level else None
    special, plain = [], []
    for token, kind in zip(meta["tokens"], meta["token_type"], strict=False):
        if kind == CONTROL and (letters is None or set(token) <= letters):
            special.append(AddedToken(token, normalized=False, special=True))
        elif kind == USER_DEFINED:
            plain.append(AddedToken(token, normalized=False, special=False))
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)


def _post_processor(tok: Any, meta: dict[str, Any]) -> None:
    from tokenizers import processors

    tokens = meta["tokens"]
    bos = tokens[meta["bos_id"]] if meta["add_bos"] and meta["bos_id"] is not None else None
    eos = tokens[meta["eos_id"]] if meta["add_eos"] and meta["eos_id"] is not None else None
    if bos is None and eos is None:
        return
    single = " ".join(p for p in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if p)
    pair = " ".join(p for p in (single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if p)
    specials = [(t, tokens.index(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    template: processors.PostProcessor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )
    if meta["model"] == "gpt2":
        template = processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
    tok.post_processor = template


def tokenizer_from_gguf(gguf: GGUFFile) -> GGUFTokenizer:
    """The tokenizer a GGUF describes. Raises `GGUFError` for a vocabulary type we cannot build."""
    meta = _metadata(gguf)
    if meta["model"] == "gpt2":
        tok = _byte_level_model(meta)
    elif meta["model"] == "llama":
        tok = _sentencepiece_model(meta)
    else:
        raise GGUFError(f"tokenizer.ggml.model: {meta['model']!r} is not supported (supported: gpt2, llama)")
    _add_special_tokens(tok, meta, byte_level=meta["model"] == "gpt2")
    _post_processor(tok, meta)
    tokens = meta["tokens"]
    config: dict[str, Any] = {"add_bos_token": meta["add_bos"], "add_eos_token": meta["add_eos"]}
    for name in ("bos", "eos", "unk", "pad"):
        if meta[f"{name}_id"] is not None:
            config[f"{name}_token"] = tokens[meta[f"{name}_id"]]
    template = gguf.get("tokenizer.chat_template", None)
    if template:
        config["chat_template"] = str(template)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    return GGUFTokenizer(tok, config)


def gguf_tokenizer_dir(path: Path, gguf: GGUFFile | None = None) -> Path:
    """A directory holding the tokenizer files of the GGUF file at `path`, built once per file and cached
    (from `gguf`, the open file, or by opening it: only when the directory is not there yet).

    Under `$PAGED_JAX_CACHE` (default `~/.cache/paged-jax`)/`gguf-tokenizers/<key>`, where the key
    hashes the file's path, size and modification time.
    """
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("PAGED_JAX_CACHE", Path.home() / ".cache" / "paged-jax"))
    directory = root / "gguf-tokenizers" / f"{path.stem}-{key}"
    if not (directory / "tokenizer_config.json").exists():
        tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
        tokenizer_from_gguf(gguf if gguf is not None else GGUFFile(path)).save(tmp)
        try:
            tmp.replace(directory)  # atomic; another process may have won the race
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


__all__ = ["GGUFTokenizer", "PRE_TOKENIZERS", "gguf_tokenizer_dir", "tokenizer_from_gguf"]
