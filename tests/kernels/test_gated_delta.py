"""The gated delta rule's two forms (pallas_kernels/gated_delta.py) against each other and against a plain numpy
loop of the rule, on random inputs: flat batches of several sequences, chunk boundaries inside sequences,
padding, an initial state, and a sequence split at odd points with the state carried across the pieces."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels.gated_delta import chunked_gated_delta_rule, recurrent_gated_delta_rule

H, DK, DV = 3, 8, 5
ATOL = 2e-5


def normalized(x: np.ndarray) -> np.ndarray:
    """`l2_normalize` in numpy (float32), so that building the inputs compiles nothing."""
    return (x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)).astype(np.float32)


def random_inputs(rng: np.random.Generator, t: int) -> tuple[np.ndarray, ...]:
    q = normalized(rng.standard_normal((t, H, DK))) * np.float32(DK**-0.5)
    k = normalized(rng.standard_normal((t, H, DK)))
    v = rng.standard_normal((t, H, DV)).astype(np.float32)
    g = -rng.uniform(0.01, 1.5, (t, H)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (t, H)).astype(np.float32)
    return q, k, v, g, beta


def numpy_rule(q, k, v, g, beta, state):
    """One sequence, token by token, in float64."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    s = np.array(state, np.float64)
    out = np.zeros((len(q), H, DV))
    for t in range(len(q)):
        s = s * np.exp(g[t])[:, None, None]
        delta = (v[t] - np.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", s, q[t])
    return out, s


def segments(lengths: list[int], pad: int = 0) -> np.ndarray:
    return np.concatenate([np.full(n, i) for i, n in enumerate(lengths)] + [np.full(pad, -1)]).astype(np.int32)


# Every test runs flat batches of T tokens, so each form compiles once per chunk size for the whole module.
T = 55


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_both_forms_match_numpy_on_a_ragged_batch(chunk):
    rng = np.random.default_rng(chunk)
    lengths, pad = [7, 1, 29, 12, 1], 5
    seg = segments(lengths, pad)
    assert len(seg) == T
    q, k, v, g, beta = random_inputs(rng, T)
    init = rng.standard_normal((H, DK, DV)).astype(np.float32)
    rec, rec_state = map(np.asarray, recurrent_gated_delta_rule(q, k, v, g, beta, seg, init))
    chk, chk_state = map(np.asarray, chunked_gated_delta_rule(q, k, v, g, beta, seg, init, chunk_size=chunk))
    start = 0
    for i, n in enumerate(lengths):
        sl = slice(start, start + n)
        want, want_state = numpy_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], init if i == 0 else np.zeros((H, DK, DV)))
        np.testing.assert_allclose(rec[sl], want, atol=ATOL)
        np.testing.assert_allclose(chk[sl], want, atol=ATOL)
        start += n
    # the final state is the last sequence's, untouched by the trailing padding
    np.testing.assert_allclose(rec_state, want_state, atol=ATOL)
    np.testing.assert_allclose(chk_state, want_state, atol=ATOL)


@pytest.mark.parametrize("chunk", [16, 64])
def test_state_carried_across_pieces_at_odd_points(chunk):
    """One 86-token sequence in pieces of 37, 1 and 48 tokens (state carried, each piece padded to T) equals it
    whole, both forms; with chunks of 16 the pieces end inside chunks, with 64 inside the first."""
    rng = np.random.default_rng(7)
    q, k, v, g, beta = random_inputs(rng, 86)
    want, want_state = numpy_rule(q, k, v, g, beta, np.zeros((H, DK, DV)))
    forms = {
        "chunked": lambda *x: chunked_gated_delta_rule(*x, chunk_size=chunk),
        "recurrent": recurrent_gated_delta_rule,
    }
    for name, form in forms.items():
        state, start, outs = np.zeros((H, DK, DV), np.float32), 0, []
        for n in (37, 1, 48):
            piece = [np.pad(x[start : start + n], [(0, T - n)] + [(0, 0)] * (x.ndim - 1)) for x in (q, k, v, g, beta)]
            out, state = form(*piece, segments([n], T - n), state)
            outs.append(np.asarray(out)[:n])
            start += n
        np.testing.assert_allclose(np.concatenate(outs), want, atol=ATOL, err_msg=name)
        np.testing.assert_allclose(np.asarray(state), want_state, atol=ATOL, err_msg=name)


def test_a_token_of_another_sequence_changes_nothing_across_the_boundary():
    """Changing sequence 0's last token leaves sequence 1's outputs bit-identical (no leak across segments), with
    the boundary inside a chunk."""
    rng = np.random.default_rng(3)
    seg = segments([20, 30], T - 50)
    q, k, v, g, beta = random_inputs(rng, T)
    zero = np.zeros((H, DK, DV), np.float32)
    changed = v.copy()
    changed[19] += 5.0
    a = np.asarray(chunked_gated_delta_rule(q, k, v, g, beta, seg, zero, chunk_size=16)[0])
    b = np.asarray(chunked_gated_delta_rule(q, k, changed, g, beta, seg, zero, chunk_size=16)[0])
    assert not np.allclose(a[19], b[19])
    np.testing.assert_array_equal(a[20:50], b[20:50])
