"""The TPU state-row kernels (`pallas_kernels.tpu.state_rows`, interpret mode) against numpy: reads equal the rows,
writes land in place with a repeated row taking the later value and every other row bit-identical; and the paged
conv and the slot copies (`paged_jax.model.linear_state`) through them equal their XLA gathers and scatters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.model.linear_state import LinearState, StateMeta, copy_slots, paged_conv
from pallas_kernels.tpu.state_rows import BLOCK, read_rows_tpu, write_rows_tpu

RNG = np.random.default_rng(7)


@pytest.mark.parametrize("num_rows", [3, BLOCK, BLOCK + 3])  # under, at and over one block of rows
def test_read_and_write_rows_in_place(num_rows):
    pool = RNG.standard_normal((21, 256)).astype(np.float32)
    pool[13] = np.nan  # a row no one names: must come back as it was (NaN compares unequal: check bits)
    rows = RNG.choice([r for r in range(21) if r != 13], num_rows).astype(np.int32)
    rows[-1] = rows[0]  # one row named twice: the later value wins
    got = read_rows_tpu(jnp.asarray(pool), jnp.asarray(rows), interpret=True)
    np.testing.assert_array_equal(np.asarray(got), pool[rows])
    new = RNG.standard_normal((num_rows, 256)).astype(np.float32)
    write = jax.jit(lambda p, r, n: write_rows_tpu(p, r, n, interpret=True), donate_argnums=0)
    out = np.asarray(write(jnp.asarray(pool), jnp.asarray(rows), jnp.asarray(new)))
    want = pool.copy()
    for i, r in enumerate(rows):
        want[r] = new[i]
    assert out.tobytes() == want.tobytes()


def test_paged_conv_through_the_row_kernels_equals_xla():
    """Three sequences (a prefill chunk continuing its row, a fresh prompt, a decode) and a padding sequence."""
    k, c, n = 4, 128, 9
    lens = [5, 3, 1, 0]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = 12  # a token bucket: 9 real tokens, 3 padding
    token_seq = np.full(t, -1, np.int32)
    for i in range(len(lens)):
        token_seq[cu[i] : cu[i + 1]] = i
    x = jnp.asarray(RNG.standard_normal((t, c)), jnp.float32)
    weight = jnp.asarray(RNG.standard_normal((k, c)), jnp.float32)
    conv = jnp.asarray(RNG.standard_normal((n, (k - 1) * c)), jnp.float32)
    slots, fresh = np.array([4, 7, 2, 0], np.int32), np.array([False, True, False, True])
    outs = {}
    for backend in ("xla", "pallas-tpu-interpret"):
        meta = StateMeta(jnp.asarray(token_seq), jnp.asarray(slots), jnp.asarray(fresh), backend)
        outs[backend] = jax.jit(paged_conv)(x, weight, conv, meta, jnp.asarray(cu))
    (out_x, rows_x), (out_k, rows_k) = outs["xla"], outs["pallas-tpu-interpret"]
    np.testing.assert_array_equal(np.asarray(out_k)[: cu[-1]], np.asarray(out_x)[: cu[-1]])
    np.testing.assert_array_equal(np.asarray(rows_k), np.asarray(rows_x))
    untouched = [r for r in range(n) if r not in slots]
    np.testing.assert_array_equal(np.asarray(rows_k)[untouched], np.asarray(conv)[untouched])


def test_slot_copies_through_the_row_kernels_equal_xla():
    """Forks and snapshot restores (`copy_slots`): a row copied to two rows, padding copying the null row."""
    state = LinearState(
        jnp.asarray(RNG.standard_normal((9, 3 * 128)), jnp.float32),
        jnp.asarray(RNG.standard_normal((9, 2, 4, 4)), jnp.float32),
    )
    src, dst = jnp.asarray([3, 3, 5, 0], jnp.int32), jnp.asarray([6, 7, 1, 0], jnp.int32)
    want = copy_slots(state, src, dst, "xla")
    got = jax.jit(copy_slots, static_argnums=3)(state, src, dst, "pallas-tpu-interpret")
    for a, b in ((got.conv, want.conv), (got.recurrent, want.recurrent)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
