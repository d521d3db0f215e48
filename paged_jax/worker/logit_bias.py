"""Logit bias (`SamplingParams.logit_bias`): a per-request map of token id -> bias added to the logits on device.

The sampler's input is two fixed-width arrays per step, `ids [S, W]` (-1 = no entry) and `values [S, W]`, with
`W` the engine's `max_logit_bias`. Every engine step carries them, all -1 where no row has a bias: ids of -1
are dropped by the scatter, so an unbiased row's logits are unchanged bit for bit, and one compiled sampler
serves biased and unbiased steps (a scatter of `S x W` entries, where a second executable per sampler
variant and row bucket would be compiled). `W = 0` traces no bias at all (tests, tools).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def apply_logit_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """logits [S, V] f32 plus values [S, W] f32 at ids [S, W] i32 (an id of -1 adds nothing): [S, V] f32."""
    rows = jnp.arange(logits.shape[0])[:, None]
    ids = jnp.where(ids >= 0, ids, logits.shape[1])  # out of range -> dropped by the scatter
    return logits.at[rows, ids].add(values, mode="drop")


def fill_logit_bias(ids: np.ndarray, values: np.ndarray, bias: dict[int, float]) -> None:
    """Write one row's `bias` (validated: at most `len(ids)` entries) into its host rows ids [W], values [W]."""
    ids[: len(bias)] = list(bias)
    values[: len(bias)] = list(bias.values())
