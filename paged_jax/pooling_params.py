"""Per-request pooling parameters (embeddings), validated at the edge, and the host-side finish of a pooled vector.

An embedding request is a prompt-only request (`max_tokens=0`) whose sequence carries `PoolingParams`: the
scheduler marks the prompt positions each step computes (`ScheduledSeq.pool_positions`), the runner sums their
final hidden states (after the final norm) per sequence on the device (`paged_jax.worker.pooling`), and the
engine adds the step's sums into the request until its prompt is computed, then ends it (an embedding has no
sample row: nothing is sampled) and frees its pages; `finish` turns the sum into the embedding: mean (sum /
prompt length) or last-token pooling, then `dimensions` truncation (Matryoshka), then L2 normalization when
`normalize` (so a truncated embedding is renormalized, as Matryoshka models expect).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paged_jax.errors import FieldError

POOLING_TYPES = ("last", "mean")  # last-token pooling (Qwen3-Embedding, e5-mistral) and mean pooling


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """`pooling`: "last" (the last prompt token's hidden state) or "mean" (the mean over every prompt token);
    `normalize`: L2-normalize the result; `dimensions`: keep the first this many components (None: all)."""

    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def validate(self, hidden_size: int) -> PoolingParams:
        """FieldError naming `pooling`, `normalize` or `dimensions` when a value is out of range."""
        if self.pooling not in POOLING_TYPES:
            raise FieldError("pooling", f"must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise FieldError("normalize", f"must be true or false, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= hidden_size):
            raise FieldError("dimensions", f"must be an integer in [1, {hidden_size}] (the model's width), got {d!r}")
        return self

    def finish(self, pooled_sum: np.ndarray, num_tokens: int) -> np.ndarray:
        """The embedding [dimensions or H] float32 from the pooled hidden states: `pooled_sum` [H] is the sum over
        the prompt's `num_tokens` positions (mean pooling) or the last position's state (last pooling)."""
        v = pooled_sum.astype(np.float64)
        if self.pooling == "mean":
            v = v / num_tokens
        if self.dimensions is not None:
            v = v[: self.dimensions]
        if self.normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        return v.astype(np.float32)
