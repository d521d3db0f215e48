"""The pooled gated delta rule (`pallas_kernels.gated_delta_pool`) against the reference recurrent form: a step of
three sequences (one fresh, two continuing the states in their pool rows) gives each sequence's outputs and final
state as the reference run from that sequence's own initial state, and leaves every other row as it was."""

from __future__ import annotations

import numpy as np

from pallas_kernels.gated_delta import l2_normalize, recurrent_gated_delta_rule
from pallas_kernels.gated_delta_pool import pooled_gated_delta_rule

H, DK, DV, N = 2, 8, 4, 6


def test_each_sequence_continues_its_own_row():
    rng = np.random.default_rng(0)
    lens, slots, fresh = [5, 1, 3], [4, 2, 5], [True, False, False]
    t = sum(lens) + 2  # two padding tokens
    q = np.asarray(l2_normalize(rng.normal(size=(t, H, DK)).astype(np.float32))) * DK**-0.5
    k = np.asarray(l2_normalize(rng.normal(size=(t, H, DK)).astype(np.float32)))
    v = rng.normal(size=(t, H, DV)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, size=(t, H)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, size=(t, H)).astype(np.float32)
    pool = rng.normal(size=(N, H, DK, DV)).astype(np.float32)
    tok_slot = np.zeros(t, np.int32)
    tok_fresh = np.zeros(t, bool)
    valid = np.zeros(t, bool)
    off = 0
    for n, slot, f in zip(lens, slots, fresh, strict=True):
        tok_slot[off : off + n], valid[off : off + n], tok_fresh[off] = slot, True, f
        off += n
    out, new = pooled_gated_delta_rule(q, k, v, g, beta, tok_slot, tok_fresh, valid, pool)
    out, new = np.asarray(out), np.asarray(new)
    off = 0
    for n, slot, f in zip(lens, slots, fresh, strict=True):
        sl = slice(off, off + n)
        init = np.zeros((H, DK, DV), np.float32) if f else pool[slot]
        ref_out, ref_state = recurrent_gated_delta_rule(
            q[sl], k[sl], v[sl], g[sl], beta[sl], np.zeros(n, np.int32), init
        )
        np.testing.assert_allclose(out[sl], ref_out, atol=1e-6)
        np.testing.assert_allclose(new[slot], ref_state, atol=1e-6)
        off += n
    untouched = [r for r in range(N) if r not in slots]
    np.testing.assert_array_equal(new[untouched], pool[untouched])  # the null row 0 (padding) included
