"""The device side of structured output: one packed bitmask of allowed tokens per sampled row.

Format (xgrammar's, outlines-core's and llguidance's): int32 `[rows, ceil(V / 32)]`, bit j of word i is token
32 i + j, 1 = allowed. A row without a constraint is all ones (-1 in every word). `apply_bitmask` is the one
op the sampler calls; it unpacks the words with shifts (no [rows, V] mask crosses the host-device link) and
sets every disallowed score to `MASK` (finite, so max - max stays finite). The unpack is skipped with a
`lax.cond` when every word is -1: no row is constrained (scripts/bench/bench_structured.py measures both ways).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import MASK_VALUE as MASK

WORD_BITS = 32


def mask_words(vocab_size: int) -> int:
    """int32 words per row of a bitmask over `vocab_size` tokens."""
    return -(-vocab_size // WORD_BITS)


def all_allowed(rows: int, vocab_size: int) -> np.ndarray:
    """A host bitmask that allows every token: int32 [rows, mask_words(vocab_size)], every word -1."""
    return np.full((rows, mask_words(vocab_size)), -1, np.int32)


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """bool [rows, vocab_size]: token t of row r is allowed (bit t % 32 of word t // 32), from int32
    `bitmask` [rows, ceil(vocab_size / 32)]. Bits past `vocab_size` in the last word are ignored."""
    rows, words = bitmask.shape
    shifts = jnp.arange(WORD_BITS, dtype=jnp.uint32)
    bits = (bitmask.astype(jnp.uint32)[:, :, None] >> shifts) & 1  # [rows, words, 32]
    return bits.reshape(rows, words * WORD_BITS)[:, :vocab_size].astype(jnp.bool_)


def apply_bitmask(scores: jax.Array, bitmask: jax.Array) -> jax.Array:
    """`scores` [rows, V] with every token the bitmask disallows set to `MASK`; `scores` itself when no row has
    a zero bit (the unpack skipped). `bitmask` int32 [rows, ceil(V / 32)]."""
    vocab = scores.shape[-1]

    def masked() -> jax.Array:
        return jnp.where(unpack_bitmask(bitmask, vocab), scores, jnp.asarray(MASK, scores.dtype))

    return jax.lax.cond(jnp.any(bitmask != -1), masked, lambda: scores)


def bitmask_of(allowed: np.ndarray) -> np.ndarray:
    """Host packing, the inverse of `unpack_bitmask`: bool [rows, V] -> int32 [rows, ceil(V / 32)] (tests and
    backends that produce boolean masks)."""
    rows, vocab = allowed.shape
    padded = np.zeros((rows, mask_words(vocab) * WORD_BITS), np.uint8)
    padded[:, :vocab] = allowed
    return np.packbits(padded, axis=-1, bitorder="little").view(np.int32).reshape(rows, -1)
