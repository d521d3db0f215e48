"""Is a string valid Unicode text, the kind any tokenizer or UTF-8 encoder accepts?

Python strings may hold lone surrogates (JSON's `"\\ud800"` decodes to one), which no UTF-8 encoder
accepts: the tokenizers library raises a bare TypeError, `str.encode` a UnicodeEncodeError, and the KV hash
of a cache salt would fail on the engine thread. Every text field is checked here first.
"""

from __future__ import annotations

from paged_jax.errors import FieldError


def check_text(text: str, field: str) -> str:
    """`text` if it is valid Unicode; otherwise a FieldError naming `field` and where the surrogate is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FieldError(field, f"not valid Unicode (a lone surrogate at character {e.start})") from None
    return text


__all__ = ["check_text"]
