"""Structured output: constraints (JSON Schema, regex, choice, grammar, structural tag) compiled to matchers on
the host, applied on the device as one packed bitmask input to the sampler.

- `backend`: the grammar-backend interface (`GrammarBackend`, `Matcher`, `GrammarError`, `StructuredLimits`).
- `llguidance_backend`: the llguidance implementation, built from the model's own tokenizer.
- `rows`: each step's constrained rows and their bitmask, filled while the device runs (the engine drives it).
- `bitmask`: the device op (unpack and mask), the sampler's only structured-output code.
"""

from paged_jax.structured.backend import GrammarBackend, GrammarError, Matcher, StructuredLimits
from paged_jax.structured.llguidance_backend import LLGuidanceBackend
from paged_jax.structured.rows import StructuredRows

__all__ = ["GrammarBackend", "GrammarError", "LLGuidanceBackend", "Matcher", "StructuredLimits", "StructuredRows"]
