"""Byte tokenizer for the tiny config and HF `tokenizer.json` loading with BOS/EOS from its configs."""

from __future__ import annotations

import json

import pytest

from paged_jax.config import load_model_config
from paged_jax.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer


def test_byte_tokenizer_ids_and_roundtrip():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.encode("A") == [1, 3 + 65]
    assert tok.encode("A", add_bos=False) == [68]
    text = "naïve 日本 🙂"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([1, 3 + 104, 2, 0, 3 + 105, 300]) == "hi"  # specials and unused ids skipped
    assert tok.decode([3 + 0xC3]) == "\ufffd"  # a cut UTF-8 sequence decodes with replacement
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(vocab_size=100)


def test_load_tokenizer_without_a_directory_is_bytes():
    tok = load_tokenizer(None, load_model_config("tiny"))
    assert isinstance(tok, ByteTokenizer) and tok.bos_token_id == 1 and tok.eos_token_ids == (2,)


def _write_hf_tokenizer(path):
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "<|eot|>": 5}
    tok = HFTok(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<|eot|>"])
    tok.save(str(path / "tokenizer.json"))


def test_hf_tokenizer_reads_special_ids(tmp_path):
    _write_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    tok = load_tokenizer(tmp_path, load_model_config("tiny"))
    assert isinstance(tok, HFTokenizer)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2, 5) and tok.vocab_size == 6
    assert tok.encode("hello world") == [1, 3, 4]
    assert tok.encode("hello", add_bos=False) == [3]
    assert tok.decode([1, 3, 4, 2]) == "hello world"


def test_hf_tokenizer_falls_back_to_model_config(tmp_path):
    _write_hf_tokenizer(tmp_path)
    config = load_model_config("tiny").replace(bos_token_id=4, eos_token_ids=(3,))
    tok = HFTokenizer(tmp_path, fallback=config)
    assert tok.bos_token_id == 4 and tok.eos_token_ids == (3,)
