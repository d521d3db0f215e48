"""What a grammar backend is: it compiles a request's `StructuredOutputs` against the model's tokenizer, makes
one matcher per constrained sequence, and fills a step's bitmask rows from those matchers.

The engine talks only to this interface (`paged_jax.structured.rows` drives it each step); llguidance is the
first implementation (`paged_jax.structured.llguidance_backend`). The mask format is the device's
(`paged_jax.structured.bitmask`), so another backend (xgrammar, outlines-core) plugs in unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from paged_jax.errors import FieldError
from paged_jax.sampling_params import StructuredOutputs


class GrammarError(FieldError):
    """A constraint the backend refuses (bad schema, grammar syntax, too large, too slow to compile), naming
    the field (`structured_outputs.json`) as every request error does."""


@dataclass(frozen=True, slots=True)
class StructuredLimits:
    """Bounds on what one request may ask of the grammar compiler (hostile schemas), from the engine config."""

    max_grammar_bytes: int = 64 * 1024  # the constraint's text (schema JSON, regex, grammar, choices)
    max_regex_expansion: int = 10_000  # atoms of one regex with its counted repetitions written out
    compile_timeout_s: float = 5.0  # wall time for one grammar to compile; slower ones are refused
    max_grammar_size: int = 200_000  # llguidance: symbols in the compiled grammar's productions
    initial_lexer_fuel: int = 1_000_000  # llguidance: work to build the lexer (~50k units per ms)
    step_lexer_fuel: int = 200_000  # llguidance: work per mask (~14k units per ms); past it the request ends


class Matcher(Protocol):
    """One sequence's position in its grammar."""

    def accept(self, token: int) -> bool:
        """Advance by the sampled `token`; False when the grammar refuses it (the matcher is then in error)."""
        ...

    def fork(self) -> Matcher:
        """An independent copy in the same state (a request's other samples)."""
        ...

    @property
    def is_stopped(self) -> bool:
        """Nothing more can follow: the output is complete."""
        ...

    @property
    def error(self) -> str:
        """Why the matcher failed ('' while it has not)."""
        ...


class GrammarBackend[M: Matcher](Protocol):
    """Builds matchers of its own kind `M` and fills the bitmask rows of those matchers."""

    vocab_size: int  # the mask covers this many token ids (the model's vocabulary, padding included)

    def matcher(self, spec: StructuredOutputs) -> M:
        """A matcher at the start of `spec`'s grammar. Raises `GrammarError` naming the field."""
        ...

    def fill(self, rows: Sequence[tuple[M, int]], bitmask: np.ndarray) -> None:
        """Write each matcher's allowed next tokens into its row of `bitmask` (int32 [R, ceil(V / 32)]), in
        parallel where the backend can; rows not named are left as they are."""
        ...
