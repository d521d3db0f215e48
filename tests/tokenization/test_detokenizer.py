"""Incremental detokenization: deltas never split a UTF-8 character; stop strings end the text."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_jax.config import load_model_config
from paged_jax.tokenization.detokenizer import Detokenizer
from paged_jax.tokenization.tokenizer import ByteTokenizer, load_tokenizer

TOK = ByteTokenizer()


def stream(text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], Detokenizer]:
    detok = Detokenizer(TOK, stop)
    deltas = []
    for token in TOK.encode(text, add_special_tokens=False):
        detok.add([token])
        deltas.append(detok.take_delta(final=False))
    deltas.append(detok.take_delta(final=True))
    return deltas, detok


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_deltas_rebuild_the_text_and_are_whole_characters(text):
    deltas, detok = stream(text)
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas if "\ufffd" not in text)


def test_multibyte_character_waits_for_its_last_byte():
    detok = Detokenizer(TOK)
    ids = TOK.encode("é", add_special_tokens=False)  # two bytes
    assert len(ids) == 2
    detok.add(ids[:1])
    assert detok.take_delta(final=False) == ""
    detok.add(ids[1:])
    assert detok.take_delta(final=False) == "é"


def test_stop_string_truncates_and_is_never_streamed():
    deltas, detok = stream("hello world, stop here", stop=("stop",))
    assert detok.stopped_on == "stop"
    assert detok.text == "hello world, "
    assert "".join(deltas) == "hello world, "


def test_earliest_of_several_stop_strings_wins():
    _, detok = stream("abcdef", stop=("de", "bc"))
    assert detok.text == "a" and detok.stopped_on == "bc"


def test_stop_strings_are_ignored_while_check_stop_is_off():
    detok = Detokenizer(TOK, ("ab",))
    for i, token in enumerate(TOK.encode("abab", add_special_tokens=False)):
        detok.add([token], check_stop=i >= 3)
    assert detok.stopped_on == "ab" and detok.text == "ab"


# -- real vocabularies: the incremental text equals one-shot decode at every prefix ---------------------------
TEXT = (
    "Grüße aus Köln! 日本語のテキスト、絵文字 🙂🚀 and ASCII. Ünïcödé “quotes” — dashes; "
    "   spaces\tand\nnewlines 1234567890 €100 ½ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"
)


def random_stream(tok, rng: np.random.Generator, n: int) -> list[int]:
    """Real text pieces (multi-byte characters split across tokens), uniform random ids, byte-fallback pieces
    (which may form invalid UTF-8) and special tokens, interleaved."""
    text_ids = tok.encode(TEXT, add_special_tokens=False)
    byte_ids = sorted(tok.open_ended_ids) or list(range(tok.vocab_size))
    specials = sorted(tok.special_ids)
    ids: list[int] = []
    while len(ids) < n:
        kind = rng.integers(4)
        if kind == 0:
            start = int(rng.integers(len(text_ids)))
            ids += text_ids[start : start + int(rng.integers(1, 12))]
        elif kind == 1:
            ids += [int(i) for i in rng.integers(0, tok.vocab_size, size=int(rng.integers(1, 4)))]
        elif kind == 2:
            ids += [int(rng.choice(byte_ids)) for _ in range(int(rng.integers(1, 6)))]
        else:
            ids.append(int(rng.choice(specials)))
    return ids[:n]


@pytest.mark.parametrize("name", ["phi-3", "gpt-2"])
@pytest.mark.parametrize("skip,spaces", [(True, True), (False, True), (False, False)])
def test_incremental_equals_one_shot_decode_at_every_prefix(real_tokenizer_dir, name, skip, spaces):
    tok = load_tokenizer(real_tokenizer_dir(name), load_model_config("tiny"))
    rng = np.random.default_rng([len(name), skip, spaces])
    for _ in range(3):
        ids = random_stream(tok, rng, 400)
        detok = Detokenizer(tok, (), skip, spaces)
        committed, streamed = "", []
        for k in range(1, len(ids) + 1):
            detok.add(ids[k - 1 : k])
            expected = tok.decode(ids[:k], skip_special_tokens=skip, spaces_between_special_tokens=spaces)
            assert detok.text + detok.pending == expected, (k, ids[max(0, k - 8) : k])
            assert detok.text.startswith(committed)  # committed text is never taken back
            committed = detok.text
            streamed.append(detok.take_delta(final=False))
        streamed.append(detok.take_delta(final=True))
        assert (
            "".join(streamed)
            == detok.text
            == tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        )


@pytest.mark.parametrize("name", ["phi-3", "gpt-2"])
def test_stop_strings_across_token_boundaries(real_tokenizer_dir, name):
    """Every stop string that spans two or more tokens ends the text right before its first occurrence, at the
    first token whose text completes it, and is never streamed."""
    tok = load_tokenizer(real_tokenizer_dir(name), load_model_config("tiny"))
    ids = tok.encode(TEXT, add_special_tokens=False)
    full = tok.decode(ids)
    checked = 0
    for start in range(0, len(full) - 6, 5):
        stop = full[start : start + 2 + start % 5]
        first = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
        if stop in tok.decode(ids[first - 1 : first]):
            continue  # inside one token: not a boundary case
        detok = Detokenizer(tok, (stop, "never appears"))
        streamed = []
        for k in range(len(ids)):
            detok.add(ids[k : k + 1])
            streamed.append(detok.take_delta(final=False))
            if detok.stopped_on is not None:
                break
        streamed.append(detok.take_delta(final=True))
        assert detok.stopped_on == stop
        assert detok.text == full[: full.find(stop)] == "".join(streamed)
        last_open = ids[first - 1] in tok.open_ended_ids  # a byte piece waits for the next token
        assert len(detok._ids) == first + (1 if last_open else 0) or last_open
        checked += 1
    assert checked > 10
