"""Incremental detokenization: text deltas that never split a UTF-8 character, and stop strings.

Decoding one token at a time is wrong for byte-level vocabularies (a character can span tokens)
and re-decoding everything is quadratic. We decode a short window: the tokens since `prefix`
(already emitted context) and hold back text while it ends in the replacement character, which
means a character is still incomplete. Stop strings are searched in the new text; text that could
still become a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from paged_jax.tokenizer import Tokenizer

_WINDOW = 6  # tokens of context kept before the unread ones (enough for merges at the boundary)


@dataclass(slots=True)
class Detokenizer:
    tokenizer: Tokenizer
    stop: Sequence[str] = ()
    text: str = ""  # all text decoded so far (including held-back text)
    emitted: int = 0  # characters of `text` already handed out
    prefix_offset: int = 0
    read_offset: int = 0
    stopped_on: str | None = None
    _ids: list[int] = field(default_factory=list)

    def add(self, token_ids: Sequence[int], check_stop: bool = True) -> None:
        """Append generated ids; extends `text` unless a stop string already ended it.

        `check_stop` False (the request is still under `min_tokens`) lets stop strings pass.
        """
        if self.stopped_on is not None:
            return
        self._ids.extend(token_ids)
        prefix_text = self.tokenizer.decode(self._ids[self.prefix_offset: self.read_offset])
        new_text = self.tokenizer.decode(self._ids[self.prefix_offset:])
        if new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text):
            return  # an incomplete character: wait for the next token
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += new_text[len(prefix_text):]
        self.read_offset = len(self._ids)
        self.prefix_offset = max(0, self.read_offset - _WINDOW)
        hits = [(at, s) for s in self.stop if check_stop and (at := self.text.find(s, search_from)) != -1]
        if hits:
            at, s = min(hits)
            self.text = self.text[:at]
            self.stopped_on = s

    def take_delta(self, final: bool) -> str:
        """Text not yet handed out. Unless `final`, keep back a tail that might begin a stop string."""
        end = len(self.text)
        if not final and self.stop and self.stopped_on is None:
            hold = max(len(s) for s in self.stop) - 1
            end = max(self.emitted, end - hold)
        delta = self.text[self.emitted: end]
        self.emitted = end
        return delta
