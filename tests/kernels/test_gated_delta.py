"""The gated delta rule's two forms (pallas_kernels/gated_delta.py) against each other and against a plain numpy
loop of the rule, on random inputs: flat batches of several sequences, chunk boundaries inside sequences,
padding, an initial state, and a sequence split at odd points with the state carried across the pieces."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import chunked_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule

H, DK, DV = 3, 8, 5
ATOL = 2e-5


def random_inputs(rng: np.random.Generator, t: int) -> tuple[jnp.ndarray, ...]:
    q = l2_normalize(jnp.asarray(rng.standard_normal((t, H, DK)), jnp.float32)) * DK**-0.5
    k = l2_normalize(jnp.asarray(rng.standard_normal((t, H, DK)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((t, H, DV)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 1.5, (t, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (t, H)), jnp.float32)
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
    init = jnp.asarray(rng.standard_normal((H, DK, DV)), jnp.float32)
    rec, rec_state = recurrent_gated_delta_rule(q, k, v, g, beta, jnp.asarray(seg), init)
    chk, chk_state = chunked_gated_delta_rule(q, k, v, g, beta, jnp.asarray(seg), init, chunk_size=chunk)
    start = 0
    for i, n in enumerate(lengths):
        sl = slice(start, start + n)
        want, want_state = numpy_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], init if i == 0 else np.zeros((H, DK, DV)))
        np.testing.assert_allclose(np.asarray(rec[sl]), want, atol=ATOL)
        np.testing.assert_allclose(np.asarray(chk[sl]), want, atol=ATOL)
        start += n
    # the final state is the last sequence's, untouched by the trailing padding
    np.testing.assert_allclose(np.asarray(rec_state), want_state, atol=ATOL)
    np.testing.assert_allclose(np.asarray(chk_state), want_state, atol=ATOL)


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
        state, start, outs = jnp.zeros((H, DK, DV), jnp.float32), 0, []
        for n in (37, 1, 48):
            piece = [
                np.pad(np.asarray(x)[start : start + n], [(0, T - n)] + [(0, 0)] * (x.ndim - 1))
                for x in (q, k, v, g, beta)
            ]
            seg = jnp.asarray(segments([n], T - n))
            out, state = form(*piece, seg, state)
            outs.append(np.asarray(out[:n]))
            start += n
        np.testing.assert_allclose(np.concatenate(outs), want, atol=ATOL, err_msg=name)
        np.testing.assert_allclose(np.asarray(state), want_state, atol=ATOL, err_msg=name)


def test_a_token_of_another_sequence_changes_nothing_across_the_boundary():
    """Changing sequence 0's last token leaves sequence 1's outputs bit-identical (no leak across segments), with
    the boundary inside a chunk."""
    rng = np.random.default_rng(3)
    seg = jnp.asarray(segments([20, 30], T - 50))
    q, k, v, g, beta = random_inputs(rng, T)
    zero = jnp.zeros((H, DK, DV), jnp.float32)
    a, _ = chunked_gated_delta_rule(q, k, v, g, beta, seg, zero, chunk_size=16)
    b, _ = chunked_gated_delta_rule(q, k, v.at[19].add(5.0), g, beta, seg, zero, chunk_size=16)
    assert not np.allclose(np.asarray(a[19]), np.asarray(b[19]))
    np.testing.assert_array_equal(np.asarray(a[20:50]), np.asarray(b[20:50]))
