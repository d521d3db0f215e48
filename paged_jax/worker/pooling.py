"""Pooling (embedding requests): the sum of the final hidden states at each scheduled sequence's marked prompt
positions, computed on the device.

The scheduler marks, per scheduled sequence, the prompt positions this step pools (`ScheduledSeq.pool_positions`:
every new prompt position for mean pooling, the last one for last-token pooling, each position once across chunks
and preemptions). The forward step returns its final hidden states [T, H] (after the final norm);
`pool_rows` gathers the marked rows and sums them per segment (one segment per marked sequence) in float32, so
only [S, H] crosses to the host however long the prompt chunk. The host adds each step's segment into its
request (`paged_jax.pooling_params.PoolingParams.finish` ends it). One executable per (T, S) bucket; a step
without marked rows runs none of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from paged_jax.sched.output import SchedulerOutput


@dataclass(slots=True)
class PoolRows:
    """The step's marked positions as flat token rows, padded to the token bucket `T`."""

    rows: np.ndarray  # [T] i32 index of each marked position in the step's flat tokens (0 for padding)
    segments: np.ndarray  # [T] i32 the marked sequence it belongs to (0.. in scheduling order; S for padding)
    num_segments: int  # marked sequences (rows of the result that are real)


def build_pool_rows(sched: SchedulerOutput, t: int, s: int) -> PoolRows | None:
    """The marked rows of `sched` for token bucket `t` and sequence bucket `s`; None when the step has none."""
    rows = np.zeros(t, np.int32)
    segments = np.full(t, s, np.int32)
    off = r = seg = 0
    for item in sched.scheduled:
        positions = item.pool_positions
        if positions:
            k = len(positions)
            first = off + positions.start - item.start  # flat index of the first marked position
            rows[r : r + k] = np.arange(first, first + k, dtype=np.int32)
            segments[r : r + k] = seg
            r += k
            seg += 1
        off += item.num_scheduled
    return PoolRows(rows, segments, seg) if seg else None


@partial(jax.jit, static_argnames=("num_segments",))
def pool_rows(hidden: jax.Array, rows: jax.Array, segments: jax.Array, *, num_segments: int) -> jax.Array:
    """hidden [T, H], rows [T] i32, segments [T] i32 (num_segments for padding) -> [num_segments, H] f32: the sum of
    each segment's rows."""
    picked = hidden[rows].astype(jnp.float32)
    return jax.ops.segment_sum(picked, segments, num_segments=num_segments + 1)[:num_segments]
