"""Which rows of a verify step are kept, decided on the device.

A speculating sequence has 1 + k consecutive sample rows (`paged_jax.sched.output.SampleRow`): row j draws the
token after its last real token and its first j drafts. The sampler draws every row from the target's
distribution as it would without speculation; row j is kept iff each earlier row i < j drew exactly draft i
(see `paged_jax.spec_decode` for why that is the rejection rule for point-mass drafts). Rows not kept read `REJECTED`
in the step's tokens, so the host appends the kept ones in row order and nothing else.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.sched.output import SchedulerOutput

REJECTED = -1  # the token id of a row that is not kept


class VerifyRows(NamedTuple):
    """Per sample row (padded to `S`): the draft its token must equal for the next row to be kept (-1: none, the
    last row of a sequence, a plain row or padding) and the first row of its sequence."""

    next_draft: np.ndarray  # [S] i32
    row_start: np.ndarray  # [S] i32


def verify_rows(sched: SchedulerOutput, s: int) -> VerifyRows:
    """The verify inputs of `sched`'s sample rows, padded to `s` (padding rows start their own run)."""
    next_draft = np.full(s, -1, np.int32)
    row_start = np.arange(s, dtype=np.int32)
    for r, row in enumerate(sched.sample_rows):
        j = len(row.draft_prefix)
        if j == 0 and not sched.scheduled[row.index].draft:
            continue
        draft = sched.scheduled[row.index].draft
        row_start[r] = r - j
        if j < len(draft):
            next_draft[r] = draft[j]
    return VerifyRows(next_draft, row_start)


def mask_rejected(tokens: jax.Array, next_draft: jax.Array, row_start: jax.Array) -> jax.Array:
    """tokens [S] with every row not kept set to `REJECTED`: row r is kept iff every row in [row_start[r], r) drew
    its `next_draft`. A mismatch count per row (exclusive running sum) makes it one pass, no loop over k."""
    miss = (tokens != next_draft).astype(jnp.int32)
    before = jnp.cumsum(miss) - miss  # mismatches in rows [0, r)
    kept = before == before[row_start]
    return jnp.where(kept, tokens, REJECTED).astype(jnp.int32)
