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
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from paged_jax.sampling_params import StructuredOutputs
from paged_jax.structured.backend import GrammarBackend, Matcher
from paged_jax.structured.bitmask import all_allowed
from paged_jax.structured.thought import ThoughtMatcher, force_row
from paged_jax.tokenization.reasoning import Thought


class StructuredRows:
    """The engine's structured-output side: matchers for new requests, bitmasks for steps, fill timings."""

    def __init__(self, backend: GrammarBackend) -> None:
        self.backend = backend
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

    def bitmask(self, rows: Sequence[tuple[Matcher, int]], num_rows: int) -> np.ndarray | None:
        """int32 [num_rows, ceil(V / 32)] with row r filled from its matcher for each (matcher, r) in `rows`,
        all ones elsewhere; None when `rows` is empty (the runner then uses its device all-ones mask)."""
        if not rows:
            return None
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
        self.backend.fill(grammar_rows, mask)
        self.fill_seconds += time.perf_counter() - t0
        self.fill_steps += 1
        self.fill_rows += len(rows)
        return mask
