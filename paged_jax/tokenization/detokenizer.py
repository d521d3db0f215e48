"""Incremental detokenization: text deltas equal to one-shot `decode`, and stop strings.

Decoding one token at a time is wrong (a character can span tokens, SentencePiece decoders strip the
first space of a string) and re-decoding everything is quadratic. We keep a *committed* boundary: a
token index where decoding is known to split cleanly, i.e. `decode(ids) == decode(ids[:b]) + rest`.
New tokens are decoded in a window that starts at an earlier committed boundary with some non-empty
text (so a stripped leading space falls inside the window on both sides), and the text past the
boundary is *pending* until it is safe to commit:

- it must not end in U+FFFD: a byte-level character still incomplete (its next byte may complete it);
- the last token must not be a byte-fallback piece (`<0xE6>`): SentencePiece-style decoders turn a whole
  run of byte pieces into U+FFFDs when any byte of the run is invalid, so a later piece can change the
  text of earlier ones (skipped special tokens do not end a run: the decoder never sees them).

Invariant, at every prefix of the id stream: `text + pending == decode(ids)` and `text` never changes
once committed (only stop strings cut it). `flush()` commits the pending tail when the sequence ends.
Stop strings are searched in committed text; text that could still become a stop string is held back
from `take_delta` until it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from paged_jax.tokenization.tokenizer import Tokenizer

_CONTEXT = 4  # tokens of committed context decoded before the new ones
_KEEP_BOUNDARIES = 64  # recent committed boundaries a window may start at


@dataclass(slots=True)
class Detokenizer:
    tokenizer: Tokenizer
    stop: Sequence[str] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    text: str = ""  # committed text (including text held back from take_delta)
    pending: str = ""  # text of the tokens after the last committed boundary, not yet final
    emitted: int = 0  # characters of `text` already handed out
    stopped_on: str | None = None
    _ids: list[int] = field(default_factory=list)
    _boundaries: list[int] = field(default_factory=lambda: [0])  # committed boundaries, ascending
    _window: int = 0  # start of the decode window (a committed boundary)
    _window_text: str = ""  # decode(ids[_window:committed])

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    @property
    def committed(self) -> int:
        """Tokens whose text is final."""
        return self._boundaries[-1]

    def add(self, token_ids: Sequence[int], check_stop: bool = True) -> None:
        """Append generated ids; extends the text unless a stop string already ended it.

        `check_stop` False (the request is still under `min_tokens`) lets stop strings pass.
        """
        if self.stopped_on is not None:
            return
        self._ids.extend(int(t) for t in token_ids)
        window_text = self._decode(self._ids[self._window :])
        if not window_text.startswith(self._window_text):  # not seen with real decoders; stay exact anyway
            self._window, self._window_text = 0, self._decode(self._ids[: self.committed])
            window_text = self._decode(self._ids)
        self.pending = window_text[len(self._window_text) :]
        if self.pending.endswith("\ufffd") or self._last_is_open_ended():
            return  # the tail may still change: wait for the next token
        self._commit(check_stop)

    def _last_is_open_ended(self) -> bool:
        """Whether the last token with text of its own is a byte-fallback piece. Skipped special tokens are
        invisible to the decoder, so byte pieces on both sides of one still form a single run."""
        open_ended = getattr(self.tokenizer, "open_ended_ids", ())
        if not open_ended:
            return False
        skipped = getattr(self.tokenizer, "special_ids", ()) if self.skip_special_tokens else ()
        for token in reversed(self._ids):
            if token not in skipped:
                return token in open_ended
        return False

    def flush(self, check_stop: bool = True) -> None:
        """The sequence ended: the pending text is final as it is."""
        if self.stopped_on is None and self.pending:
            self._commit(check_stop)

    def _commit(self, check_stop: bool) -> None:
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += self.pending
        self.pending = ""
        self._boundaries.append(len(self._ids))
        self._move_window()
        hits = [(at, s) for s in self.stop if check_stop and (at := self.text.find(s, search_from)) != -1]
        if hits:
            at, s = min(hits)
            self.text = self.text[:at]
            self.stopped_on = s

    def _move_window(self) -> None:
        """Start the next window at the latest boundary at least `_CONTEXT` tokens back whose text up to the
        committed boundary is non-empty (else at 0, which is one-shot decoding)."""
        end = self.committed
        self._window, self._window_text = 0, ""
        for start in reversed(self._boundaries[:-1]):
            if end - start >= _CONTEXT and (text := self._decode(self._ids[start:end])):
                self._window, self._window_text = start, text
                break
        else:
            self._window_text = self._decode(self._ids[:end])
        del self._boundaries[: max(0, len(self._boundaries) - _KEEP_BOUNDARIES)]

    def take_delta(self, final: bool) -> str:
        """Text not yet handed out. `final` flushes the pending text first; otherwise a tail that might begin
        a stop string is kept back."""
        if final:
            self.flush()
        end = len(self.text)
        if not final and self.stop and self.stopped_on is None:
            hold = max(len(s) for s in self.stop) - 1
            end = max(self.emitted, end - hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
