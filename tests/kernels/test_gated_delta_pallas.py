"""The gated delta rule over a paged step (`pallas_kernels.ragged_gated_delta`): the TPU and GPU kernels in
interpret mode and the XLA path against the jnp reference (`pallas_kernels.gated_delta.recurrent_gated_delta_rule`, run
per sequence from its own initial state), on random ragged batches that mix fresh prompts, continued chunks
and decodes, with the memory a correct kernel never reads poisoned (NaN): padding tokens, the pool rows of
fresh sequences and the rows no sequence of the step owns (which must come back unchanged)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import recurrent_gated_delta_rule
from pallas_kernels.gated_delta_plan import chunk_items, decode_items, gated_delta_work, plan_gated_delta
from pallas_kernels.ragged_gated_delta import ragged_gated_delta_rule, resolve_backend

H, DK, DV, SLOTS, MAX_SEQS = 2, 32, 16, 9, 7


@dataclasses.dataclass(frozen=True)
class Step:
    """One step's operands (the entry point's argument order) and the pool before it."""

    q: np.ndarray  # [T, H, DK]
    k: np.ndarray
    v: np.ndarray  # [T, H, DV]
    g: np.ndarray  # [T, H]
    beta: np.ndarray
    cu_q_lens: np.ndarray  # [MAX_SEQS + 1]
    num_seqs: np.ndarray  # [1]
    slots: np.ndarray  # [MAX_SEQS]
    fresh: np.ndarray  # [MAX_SEQS]

    def args(self, dtype) -> tuple:
        cast = lambda x: jnp.asarray(x, dtype)
        return (
            cast(self.q),
            cast(self.k),
            cast(self.v),
            jnp.asarray(self.g),
            jnp.asarray(self.beta),
            *(jnp.asarray(x) for x in (self.cu_q_lens, self.num_seqs, self.slots, self.fresh)),
        )


def make_step(rng, lens, slots, fresh, num_tokens) -> Step:
    """Random rows (unit q/k as the layer makes them, q scaled), NaN in the padding tokens past the last."""
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    t = num_tokens
    q = unit(rng.standard_normal((t, H, DK))) * DK**-0.5
    k = unit(rng.standard_normal((t, H, DK)))
    v = rng.standard_normal((t, H, DV))
    g = -rng.uniform(0.01, 0.7, (t, H))
    beta = rng.uniform(0.05, 0.95, (t, H))
    real = sum(lens)
    for x in (q, k, v, g, beta):
        x[real:] = np.nan
    cu = np.full(MAX_SEQS + 1, real, np.int32)
    cu[0] = 0
    cu[1 : len(lens) + 1] = np.cumsum(lens)
    pad = MAX_SEQS - len(lens)
    return Step(
        *(x.astype(np.float32) for x in (q, k, v, g, beta)),
        cu,
        np.array([len(lens)], np.int32),
        np.array(list(slots) + [0] * pad, np.int32),
        np.array(list(fresh) + [True] * pad, bool),
    )


def make_pool(rng, step: Step) -> np.ndarray:
    """Random rows; NaN in the rows of fresh sequences (never read) and in rows no sequence owns."""
    pool = (rng.standard_normal((SLOTS, H, DK, DV)) * 0.3).astype(np.float32)
    owned = set(step.slots[: step.num_seqs[0]].tolist())
    for s in range(SLOTS):
        if s not in owned:
            pool[s] = np.nan
    for s in range(step.num_seqs[0]):
        if step.fresh[s]:
            pool[step.slots[s]] = np.nan
    return pool


def reference(step: Step, pool: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence through the jnp reference from its row (zeros when fresh), on the inputs as `dtype`."""
    q, k, v, g, beta, *_ = step.args(dtype)
    out = np.zeros((q.shape[0], H, DV), np.float32)
    new = pool.copy()
    for s in range(step.num_seqs[0]):
        a, b = step.cu_q_lens[s], step.cu_q_lens[s + 1]
        init = jnp.zeros((H, DK, DV)) if step.fresh[s] else jnp.asarray(pool[step.slots[s]])
        seg = jnp.zeros(b - a, jnp.int32)
        o, state = recurrent_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], seg, init)
        out[a:b], new[step.slots[s]] = np.asarray(o), np.asarray(state)
    return out, new


def check(step: Step, pool: np.ndarray, backend: str, dtype, chunk_size: int) -> np.ndarray:
    """Runs the step and compares out and pool with the reference; returns the new pool."""
    out, new = ragged_gated_delta_rule(*step.args(dtype), jnp.asarray(pool), backend=backend, chunk_size=chunk_size)
    ref_out, ref_pool = reference(step, pool, dtype)
    atol = 2e-5 if dtype == jnp.float32 else 5e-5  # f32 arithmetic on the same (rounded) inputs
    out, new = np.asarray(out), np.asarray(new)
    assert np.all(np.isfinite(out)), "padding or a never-read row leaked into the outputs"
    np.testing.assert_allclose(out, ref_out, atol=atol, rtol=1e-4)
    owned = [step.slots[s] for s in range(step.num_seqs[0])]
    for s in range(SLOTS):
        if s in owned:
            np.testing.assert_allclose(new[s], ref_pool[s], atol=atol, rtol=1e-4, err_msg=f"slot {s}")
        else:
            np.testing.assert_array_equal(new[s], pool[s], err_msg=f"slot {s} is no sequence's: unchanged")
    return new


# Sequences of 37 (continued), 1 (a decode), 21 (fresh), 1 (fresh decode), 5, then padding tokens and
# sequences: every kind of item, odd offsets, chunk boundaries inside the long sequences (chunks of 16 here).
LENS, SEQ_SLOTS, FRESH = (37, 1, 21, 1, 5), (3, 5, 1, 8, 2), (False, False, True, True, False)
T = sum(LENS) + 3  # one shape for every interpret-mode call of a dtype: the interpreter's compile is the cost


def test_tpu_kernels_match_the_reference_on_a_mixed_step():
    rng = np.random.default_rng(0)
    step = make_step(rng, LENS, SEQ_SLOTS, FRESH, num_tokens=T)
    check(step, make_pool(rng, step), "pallas-tpu-interpret", jnp.float32, chunk_size=16)


def test_tpu_kernels_bf16_inputs_at_the_production_chunk_of_64():
    """bfloat16 q/k/v (float32 state) and chunks of 64: a 70-token sequence is a full chunk and a part."""
    rng = np.random.default_rng(1)
    step = make_step(rng, (3, 1, 70, 1, 5), SEQ_SLOTS, (False, False, True, False, True), num_tokens=83)
    check(step, make_pool(rng, step), "pallas-tpu-interpret", jnp.bfloat16, chunk_size=64)


@pytest.mark.parametrize("backend", ["xla", "pallas-tpu-interpret"])
def test_state_is_carried_across_steps(backend):
    """One sequence in pieces of 37, 1 and 18 tokens over three steps (beside another sequence) ends in the
    state, and gives the outputs, of the whole sequence in one piece."""
    rng = np.random.default_rng(3)
    whole = make_step(rng, (56,), (7,), (True,), num_tokens=56)
    pool = make_pool(rng, whole)
    ref_out, ref_pool = reference(whole, pool, jnp.float32)
    outs, start = [], 0
    for i, n in enumerate((37, 1, 18)):
        other = make_step(rng, (n, 3), (7, 2), (i == 0, True), num_tokens=T)
        rows = {f: getattr(other, f).copy() for f in ("q", "k", "v", "g", "beta")}
        for f, x in rows.items():
            x[:n] = getattr(whole, f)[start : start + n]
        piece = dataclasses.replace(other, **rows)
        out, new = ragged_gated_delta_rule(*piece.args(jnp.float32), jnp.asarray(pool), backend=backend, chunk_size=16)
        outs.append(np.asarray(out)[:n])
        pool, start = np.asarray(new), start + n
    np.testing.assert_allclose(np.concatenate(outs), ref_out, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(pool[7], ref_pool[7], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["xla", "pallas-gpu-interpret"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_xla_and_gpu_paths_match_the_reference_on_a_mixed_step(dtype, backend):
    rng = np.random.default_rng(4)
    step = make_step(rng, LENS, SEQ_SLOTS, FRESH, num_tokens=T)
    check(step, make_pool(rng, step), backend, dtype, chunk_size=16)


@pytest.mark.parametrize("backend", ["xla", "pallas-tpu-interpret", "pallas-gpu-interpret"])
def test_a_decode_only_step(backend):
    """Every sequence one token (the TPU decode kernel alone; one program a sequence on GPU), fresh ones and
    padding sequences included."""
    rng = np.random.default_rng(7)
    step = make_step(rng, (1,) * 5, (4, 1, 6, 2, 3), (False, True, False, False, True), num_tokens=T)
    check(step, make_pool(rng, step), backend, jnp.float32, chunk_size=16)


def test_backend_choice_and_refusal():
    assert resolve_backend("auto", "tpu") == "pallas-tpu"
    assert resolve_backend("auto", "cpu") == "xla"
    assert resolve_backend("auto", "gpu") == "pallas-gpu"
    assert resolve_backend("pallas-tpu-interpret", "cpu") == "pallas-tpu-interpret"
    with pytest.raises(ValueError, match="backend='triton'"):
        resolve_backend("triton")


def test_work_lists_and_work_model():
    """The items the kernels walk, and the work model summed over the same lists."""
    step = make_step(np.random.default_rng(5), LENS, SEQ_SLOTS, FRESH, num_tokens=T)
    plan = plan_gated_delta(T, MAX_SEQS, H, DK, DV, chunk=16)
    meta = (step.cu_q_lens, step.num_seqs[0], step.slots, step.fresh)
    chunks, decodes = chunk_items(np, plan, *meta), decode_items(np, plan, *meta)
    real = chunks.n > 0
    # 37 -> 16 16 5; 21 -> 16 5; 5 -> 5
    assert chunks.n[real].tolist() == [16, 16, 5, 16, 5, 5]
    assert chunks.t0[real].tolist() == [0, 16, 32, 38, 54, 60]
    assert chunks.slot[real].tolist() == [3, 3, 3, 1, 1, 2]
    assert chunks.flags[real].tolist() == [1, 0, 2, 1 | 4, 2, 3]  # FIRST, LAST, FRESH bits
    assert int(real.sum()) <= plan.chunk_items
    assert decodes.t0[decodes.n > 0].tolist() == [37, 59] and decodes.slot[decodes.n > 0].tolist() == [5, 8]
    assert decodes.t0[decodes.n == 0].tolist() == [plan.num_tokens] * (plan.decode_items - 2)
    chunk_work, decode_work = gated_delta_work(plan, step.cu_q_lens, int(step.num_seqs[0]), 4, rows=32)
    state = H * DK * DV * 4
    assert chunk_work.programs == 6 and chunk_work.kv_bytes_read == 3 * 2 * state
    assert decode_work.programs == 2 and decode_work.kv_bytes_read == 2 * 2 * state
    assert 0 < chunk_work.useful_flops < chunk_work.issued_flops


def test_entry_point_is_jit_safe_with_a_donated_pool():
    """Under the caller's jit with the pool donated (the engine's way), the XLA path updates it in place."""
    rng = np.random.default_rng(6)
    step = make_step(rng, (4, 1), (1, 2), (True, False), num_tokens=6)
    pool = jnp.asarray(np.nan_to_num(make_pool(rng, step)))
    fn = jax.jit(lambda p, *a: ragged_gated_delta_rule(*a, p, backend="xla"), donate_argnums=0)
    text = fn.lower(pool, *step.args(jnp.float32)).compile().as_text()
    assert "input_output_alias" in text or "may-alias" in text or "must-alias" in text
