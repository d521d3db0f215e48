"""Tokenization equals the model's own tokenizer: real vocabularies, llama.cpp's vectors, transformers' ids,
special tokens with their precedence, and the byte tokenizer of the tiny config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paged_jax.config import load_model_config
from paged_jax.tokenization.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

TOKENIZER_DATA = Path(__file__).resolve().parents[1] / "data" / "tokenizers"

GOLDEN = json.loads((TOKENIZER_DATA / "golden.json").read_text(encoding="utf-8"))


def vectors(name: str) -> list[tuple[str, list[int]]]:
    texts = (TOKENIZER_DATA / name / "vectors.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    lines = (TOKENIZER_DATA / name / "vectors.out").read_text(encoding="utf-8").split("\n")
    assert texts[-1] == "" and len(texts) - 1 == 46
    return [(text, [int(v) for v in line.split()]) for text, line in zip(texts[:-1], lines, strict=False)]


@pytest.fixture(scope="module", params=["phi-3", "gpt-2"])
def real(request, real_tokenizer_dir) -> tuple[str, HFTokenizer]:
    tok = load_tokenizer(real_tokenizer_dir(request.param), load_model_config("tiny"))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    return request.param, tok


def test_llama_cpp_vectors_without_special_tokens(real):
    name, tok = real
    for text, expected in vectors(name):
        assert tok.encode(text, add_special_tokens=False) == expected, text


def test_prompt_ids_follow_the_post_processor(real):
    """BOS comes from the tokenizer's post-processor: present for Phi-3, absent for GPT-2 (whose config names
    <|endoftext|> as BOS all the same), exactly the ids transformers gives."""
    name, tok = real
    golden = GOLDEN["tokenizers"][name]["encode_with_special_tokens"]
    for (text, plain), expected in zip(vectors(name), golden, strict=True):
        ids = tok.encode(text)
        assert ids == expected, text
        assert ids == ([1] + plain if name == "phi-3" else plain)
    assert tok.bos_token_id == GOLDEN["tokenizers"][name]["bos_token_id"]


def test_decode_matches_transformers(real):
    name, tok = real
    for case in GOLDEN["tokenizers"][name]["decode"]:
        assert tok.decode(case["ids"]) == case["skip"]
        assert tok.decode(case["ids"], skip_special_tokens=False) == case["keep"]


def test_special_tokens_of_the_real_directories(real):
    name, tok = real
    golden = GOLDEN["tokenizers"][name]
    assert tok.special.bos_token == golden["bos_token"] and tok.special.eos_token == golden["eos_token"]
    assert tok.eos_token_ids == (golden["eos_token_id"],)
    assert tok.special.sources["eos"] == "tokenizer_config.json"


def test_spaces_between_special_tokens_off_keeps_added_tokens_as_written(real_tokenizer_dir):
    tok = load_tokenizer(real_tokenizer_dir("phi-3"), load_model_config("tiny"))
    ids = [32001, 29871, 7251, 32007]  # <|assistant|> ▁ ▁hi <|end|>
    assert tok.decode(ids, skip_special_tokens=False) == "<|assistant|>  hi<|end|>"
    assert tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == "<|assistant|> hi<|end|>"
    assert tok.decode(ids, spaces_between_special_tokens=False) == tok.decode(ids) == " hi"


def test_byte_tokenizer_ids_and_roundtrip():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.encode("A") == [1, 3 + 65]
    assert tok.encode("A", add_special_tokens=False) == [68]
    text = "naïve 日本 🙂"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([1, 3 + 104, 2, 0, 3 + 105, 300]) == "hi"  # specials and unused ids skipped
    assert tok.decode([3 + 0xC3]) == "\ufffd"  # a cut UTF-8 sequence decodes with replacement
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(vocab_size=100)


def test_load_tokenizer_without_a_directory_is_bytes():
    tok = load_tokenizer(None, load_model_config("tiny"))
    assert isinstance(tok, ByteTokenizer) and tok.bos_token_id == 1 and tok.eos_token_ids == (2,)


def _write_hf_tokenizer(path, bos_in_post_processor: bool):
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "<|eot|>": 5, "<|endoftext|>": 6}
    tok = HFTok(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<|eot|>", "<|endoftext|>"])
    if bos_in_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))


def test_special_token_precedence(tmp_path):
    """Strings of tokenizer_config.json beat special_tokens_map.json; ids of generation_config.json beat
    config.json; every EOS of generation_config.json and config.json joins the tokenizer's own."""
    _write_hf_tokenizer(tmp_path, bos_in_post_processor=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "<|eot|>", "pad_token": "<|endoftext|>"})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2], "pad_token_id": 0}))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 4, "eos_token_id": 6}))
    tok = load_tokenizer(tmp_path, load_model_config("tiny"))
    s = tok.special
    assert (s.bos_token, s.bos_token_id, s.sources["bos"]) == ("<s>", 1, "special_tokens_map.json")
    assert (s.eos_token, s.eos_token_id, s.sources["eos"]) == ("</s>", 2, "tokenizer_config.json")
    assert (s.pad_token, s.pad_token_id) == ("<|endoftext|>", 6)
    assert tok.eos_token_ids == (2, 5, 6)
    assert tok.encode("hello world") == [1, 3, 4]
    assert tok.encode("hello", add_special_tokens=False) == [3]
    assert tok.decode([1, 3, 4, 2]) == "hello world"
    assert tok.decode([1, 3, 4, 2], skip_special_tokens=False) == "<s> hello world </s>"  # WordLevel's decoder


def test_a_bos_named_in_the_configs_is_not_added_when_the_post_processor_adds_none(tmp_path):
    """The Qwen2 case: config.json names a BOS id, the tokenizer never adds one, so prompts start without it."""
    _write_hf_tokenizer(tmp_path, bos_in_post_processor=False)
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 6, "eos_token_id": 6}))
    tok = load_tokenizer(tmp_path, load_model_config("tiny"))
    assert tok.bos_token_id == 6 and tok.special.bos_token is None and tok.special.sources["bos"] == "config.json"
    assert tok.encode("hello world") == [3, 4]
    assert tok.eos_token_ids == (6,)


def test_hf_tokenizer_falls_back_to_model_config(tmp_path):
    _write_hf_tokenizer(tmp_path, bos_in_post_processor=False)
    config = load_model_config("tiny").replace(bos_token_id=4, eos_token_ids=(3,))
    tok = HFTokenizer.from_dir(tmp_path, fallback=config)
    assert tok.bos_token_id == 4 and tok.eos_token_ids == (3,)
    assert tok.special.sources == {"bos": "model config", "eos": "model config"}
