"""A reply's thought under a budget, and structured output applied to the answer after it.

`ThoughtMatcher` is a `Matcher` over a request's token ids: while the model thinks its row is unconstrained;
once the thought has `budget` tokens (`SamplingParams.max_reasoning_tokens`) it forces the end tag token by
token (the rest of it, when the model had begun writing it), and the answer continues. The constraint of
the request, if any (a JSON schema, a forced tool call), is an inner matcher that starts after the end tag:
the thought is free text, the answer follows the grammar. A reply that starts before a thought (Qwen3's
prompt leaves the model to open it) with an inner constraint is made to open one, since the grammar could
not tell thought from answer otherwise; without one, a reply that does not open a thought is the answer.

The engine's step masks only the rows that need it (`needs_mask`): with the one-step lookahead a row's mask
is filled before its previous token is known, so a row is left unmasked only while no token it can still get
before its next sample would bring the budget, or the end of the thought with an inner constraint.
"""

from __future__ import annotations

import numpy as np

from paged_jax.structured.backend import Matcher
from paged_jax.structured.bitmask import WORD_BITS
from paged_jax.tokenization.reasoning import State, Thought


class ThoughtMatcher:
    """One sample's place in its thought (see the module docstring); `inner`: the answer's matcher."""

    __slots__ = ("_thought", "_budget", "inner", "state", "_count", "_tail", "_error")

    def __init__(self, thought: Thought, budget: int | None, inner: Matcher | None) -> None:
        self._thought, self._budget, self.inner = thought, budget, inner
        self.state: State = thought.state
        self._count = 0  # tokens in the thought so far (the end tag's included while it is written)
        self._tail: list[int] = []  # the last tokens (as many as a tag has): a tag being written
        self._error = ""

    # -- the Matcher protocol ---------------------------------------------------------------------
    def accept(self, token: int) -> bool:
        token = int(token)
        forced = self.forced()
        if forced is not None and token != forced:
            self._error = f"token {token} refused: the thought's tag needs token {forced}"
            return False
        if self.state == "answer":
            return True if self.inner is None else self.inner.accept(token)
        if self.state == "before":
            self._tail.append(token)
            start = self._thought.start_ids
            if tuple(self._tail) == start[: len(self._tail)]:
                if len(self._tail) == len(start):
                    self.state, self._tail = "thinking", []
                return True
            self.state = "answer"  # no thought: the tokens so far are the answer (no inner: `forced` above)
            return True
        self._count += 1
        self._tail = (self._tail + [token])[-len(self._thought.end_ids) :]
        if tuple(self._tail) == self._thought.end_ids:
            self.state, self._tail = "answer", []
        return True

    def fork(self) -> ThoughtMatcher:
        other = ThoughtMatcher(self._thought, self._budget, None if self.inner is None else self.inner.fork())
        other.state, other._count, other._tail, other._error = self.state, self._count, list(self._tail), self._error
        return other

    @property
    def is_stopped(self) -> bool:
        return self.state == "answer" and self.inner is not None and self.inner.is_stopped

    @property
    def error(self) -> str:
        return self._error or (self.inner.error if self.inner is not None else "")

    # -- what the step's mask needs -----------------------------------------------------------------
    def _partial_end(self) -> int:
        """How many of the end tag's first tokens the thought ends with."""
        end = self._thought.end_ids
        for k in range(min(len(end) - 1, len(self._tail)), 0, -1):
            if tuple(self._tail[-k:]) == end[:k]:
                return k
        return 0

    def forced(self) -> int | None:
        """The one token the next sample must be (a tag being forced), or None."""
        if self.state == "before" and self.inner is not None:
            return self._thought.start_ids[len(self._tail)]
        if self.state != "thinking" or self._budget is None:
            return None
        written = self._partial_end()
        if self._count - written < self._budget:
            return None
        return self._thought.end_ids[written]

    def answer_matcher(self) -> Matcher | None:
        """The inner matcher when it decides the next token's mask (the answer is under way)."""
        return self.inner if self.state == "answer" else None

    def needs_mask(self) -> bool:
        """False when the next sample is unconstrained whatever the one token still on its way may be."""
        if self.state == "answer":
            return self.inner is not None
        if self.state == "before":
            return self.inner is not None or self._budget is not None
        within = self._budget is None or self._count + 2 <= self._budget
        closing = self.inner is not None and self._partial_end() + 1 >= len(self._thought.end_ids)
        return not within or closing


def force_row(row: np.ndarray, token: int) -> None:
    """Make a bitmask row (int32 [ceil(V / 32)]) allow `token` alone."""
    row[:] = 0
    row[token // WORD_BITS] = np.array([1 << (token % WORD_BITS)], np.uint32).view(np.int32)[0]
