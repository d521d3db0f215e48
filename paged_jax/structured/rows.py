"""Each step's structured-output rows on the host: which sample rows carry a matcher, and their bitmask.

The engine owns one matcher per constrained sequence (in its request state). Before a step's sampling is
dispatched, `StructuredRows.bitmask` fills the packed masks of that step's constrained rows (the backend's
parallel fill) while the device runs the step's forward pass; unconstrained rows stay all ones.

With the one-step lookahead (`paged_jax.engine.lookahead`) step n+1 is scheduled before step n's tokens reach the
host, but a constrained row's mask for step n+1 depends on its token from step n. So a step with a
constrained row is dispatched in two halves: its forward pass at once (it needs no mask: the token still on
the device is merged there), its sampling only after step n's tokens are on the host, have advanced the
matchers, and the masks are filled. Unconstrained steps are dispatched whole, as before. What the split costs
is the host time between step n's samples and step n+1's sampling (finishing step n, then the fill) that the
device no longer hides behind step n+1's forward pass: `scripts/bench/bench_structured.py` measures it.

With a per-step budget (`EngineConfig.structured_fill_budget_s`) no row's host work holds a step past it: the
rows are filled one thread each (`paged_jax.structured.fill_budget`) and a row whose fill is not done in time is
reported late (`StepMask.late`); a grammar advance (`advance`) that took longer than the budget ends its row too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from paged_jax.sampling_params import StructuredOutputs
from paged_jax.structured.backend import GrammarBackend, Matcher
from paged_jax.structured.bitmask import all_allowed, mask_words
from paged_jax.structured.fill_budget import BudgetedFill
from paged_jax.structured.thought import ThoughtMatcher, force_row
from paged_jax.tokenization.reasoning import Thought


@dataclass(frozen=True, slots=True)
class StepMask:
    """A step's bitmask (int32 [rows, ceil(V / 32)]; None: no row constrained) and the sample rows whose fill
    passed the per-step budget (their mask rows all ones: their samples are to be discarded)."""

    bitmask: np.ndarray | None
    late: frozenset[int] = frozenset()


class StructuredRows:
    """The engine's structured-output side: matchers for new requests, bitmasks for steps, fill timings.

    `budget_s`: the host time one row may take in a step, its mask fill and its grammar advance each (None: no
    budget, every row filled by one parallel call on the engine thread); `clock`: what times an advance."""

    def __init__(
        self, backend: GrammarBackend, budget_s: float | None = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.backend = backend
        self.budget_s, self._clock = budget_s, clock
        words = mask_words(backend.vocab_size)
        self._budgeted = None if budget_s is None else BudgetedFill(backend.fill, words, budget_s)
        self.late_rows = 0  # rows ended by the budget (a fill or an advance past it), summed over steps
        self.fill_seconds = 0.0  # host time filling masks, summed over steps
        self.fill_steps = 0  # steps that filled at least one constrained row
        self.fill_rows = 0  # constrained rows filled, summed over steps

    def matchers(self, spec: StructuredOutputs, n: int) -> list[Matcher]:
        """One matcher per sample of a request (compiled once, then copied). Raises `GrammarError`."""
        first = self.backend.matcher(spec)
        return [first] + [first.fork() for _ in range(n - 1)]

    @staticmethod
    def needs_mask(matcher: Matcher) -> bool:
        """Whether a row's next sample needs its mask (a thought's free text does not: `ThoughtMatcher`)."""
        return not isinstance(matcher, ThoughtMatcher) or matcher.needs_mask()

    def with_thought(
        self, inner: list[Matcher] | None, n: int, thought: Thought | None, budget: int | None
    ) -> list[Matcher] | None:
        """A request's matchers: its constraint's (`inner`, one per sample, compiled by `matchers`), each inside a
        `ThoughtMatcher` when its reply has a thought (a budget, or a constraint that applies to the answer only);
        None when nothing constrains it."""
        if thought is None or thought.state == "answer" or (inner is None and budget is None):
            return inner
        return [ThoughtMatcher(thought, budget, None if inner is None else inner[i]) for i in range(n)]

    def bitmask(self, rows: Sequence[tuple[Matcher, int]], num_rows: int) -> StepMask:
        """The mask int32 [num_rows, ceil(V / 32)] with row r filled from its matcher for each (matcher, r) in
        `rows`, all ones elsewhere (None when `rows` is empty: the runner then uses its device all-ones mask),
        and the rows late past the budget."""
        if not rows:
            return StepMask(None)
        t0 = time.perf_counter()
        mask = all_allowed(num_rows, self.backend.vocab_size)
        grammar_rows = []
        for m, r in rows:
            if not isinstance(m, ThoughtMatcher):
                grammar_rows.append((m, r))
            elif (token := m.forced()) is not None:
                force_row(mask[r], token)
            elif (inner := m.answer_matcher()) is not None:
                grammar_rows.append((inner, r))
        late: list[int] = []
        if self._budgeted is None:
            self.backend.fill(grammar_rows, mask)
        elif grammar_rows:
            late = self._budgeted.fill(grammar_rows, mask)
        self.fill_seconds += time.perf_counter() - t0
        self.fill_steps += 1
        self.fill_rows += len(rows)
        self.late_rows += len(late)
        return StepMask(mask, frozenset(late))

    def late_message(self) -> str:
        """Why a row late past the budget ended (its sequence's stop reason)."""
        return (
            f"structured output: the grammar took longer than the server's budget of {self.budget_s} s per step "
            "for this row (structured_fill_budget_s)"
        )

    def advance(self, matcher: Matcher, token: int) -> str | None:
        """Advance `matcher` by the sampled `token`; None, or why its row must end: the grammar refused the token
        (or failed), or the advance took longer than the budget."""
        t0 = self._clock()
        accepted = matcher.accept(token)
        seconds = self._clock() - t0
        if not accepted:
            return f"structured output: {matcher.error or f'token {token} refused'}"
        if self.budget_s is not None and seconds > self.budget_s:
            self.late_rows += 1
            return self.late_message()
        return None
