"""Incremental detokenization: deltas never split a UTF-8 character; stop strings end the text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from paged_jax.detokenizer import Detokenizer
from paged_jax.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def stream(text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], Detokenizer]:
    detok = Detokenizer(TOK, stop)
    deltas = []
    for token in TOK.encode(text, add_bos=False):
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
    ids = TOK.encode("é", add_bos=False)  # two bytes
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
    for i, token in enumerate(TOK.encode("abab", add_bos=False)):
        detok.add([token], check_stop=i >= 3)
    assert detok.stopped_on == "ab" and detok.text == "ab"
