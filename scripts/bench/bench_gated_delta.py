"""Prefill and decode tokens/s of the gated delta rule (Qwen3.5's linear attention, one layer) on this machine:
the chunked and the recurrent form of `pallas_kernels/gated_delta.py` beside a plain `jax.lax.scan` of the rule
in `jnp` (one sequence, no segment handling), side by side in one run, with their ratios.

- prefill: one sequence of ``--tokens`` tokens from a zero state (tokens/s = tokens / seconds per call);
- decode: one token continuing a random state (tokens/s = 1 / seconds per call);
- shapes: ``qwen3.5-9b`` (32 value heads, Dk = Dv = 128: Qwen3.5-9B's linear layers) and ``small`` (8 heads,
  Dk = Dv = 32); each row also prints the largest |difference| of its outputs from the baseline's.

Each function is jitted and compiled before timing; a figure is the best of ``--reps`` calls for prefill and of
ten times as many for decode (other processes only ever slow a call down), the forms taking turns call by call.

    JAX_PLATFORMS=cpu python scripts/bench/bench_gated_delta.py [--tokens 512] [--reps 3] [--shapes qwen3.5-9b small]

``--paged`` times the paged step's entry point instead (``pallas_kernels.ragged_gated_delta``, the XLA path
``auto`` picks on CPU): a step of ``--seqs`` one-token sequences (decode) and one of a ``--tokens`` prompt
beside ``--seqs - 1`` decodes (mixed), each sequence continuing its row of a state pool: the entry point (its
token scan over the pool) beside the per-sequence reference (``recurrent_gated_delta_rule`` called once per
sequence from its row, no pool); tokens/s and the largest |difference| from the reference.

    JAX_PLATFORMS=cpu python scripts/bench/bench_gated_delta.py --paged [--seqs 64] [--tokens 512] [--reps 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gated_delta import chunked_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    heads: int  # value heads (q/k already repeated to them)
    dk: int
    dv: int


SHAPES = {s.name: s for s in (Shape("qwen3.5-9b", 32, 128, 128), Shape("small", 8, 32, 32))}


@dataclasses.dataclass(frozen=True)
class Inputs:
    q: jax.Array  # [T, H, Dk]
    k: jax.Array  # [T, H, Dk]
    v: jax.Array  # [T, H, Dv]
    g: jax.Array  # [T, H]
    beta: jax.Array  # [T, H]
    segment_ids: jax.Array  # [T] int32 (all 0: one sequence)
    state: jax.Array  # [H, Dk, Dv] float32


def random_inputs(shape: Shape, t: int, seed: int, zero_state: bool) -> Inputs:
    rng = np.random.default_rng(seed)
    h, dk, dv = shape.heads, shape.dk, shape.dv
    f32 = jnp.float32
    state = np.zeros((h, dk, dv)) if zero_state else rng.standard_normal((h, dk, dv)) * 0.1
    return Inputs(
        q=l2_normalize(jnp.asarray(rng.standard_normal((t, h, dk)), f32)) * dk**-0.5,
        k=l2_normalize(jnp.asarray(rng.standard_normal((t, h, dk)), f32)),
        v=jnp.asarray(rng.standard_normal((t, h, dv)), f32),
        g=-jnp.asarray(rng.uniform(0.01, 1.0, (t, h)), f32),
        beta=jnp.asarray(rng.uniform(0.0, 1.0, (t, h)), f32),
        segment_ids=jnp.zeros((t,), jnp.int32),
        state=jnp.asarray(state, f32),
    )


@jax.jit
def scan_baseline(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The rule token by token in plain `jnp` for one sequence: (out [T, H, Dv], final state [H, Dk, Dv])."""

    def step(s: jax.Array, x: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, g_t, b_t = x
        s = s * jnp.exp(g_t)[:, None, None]
        delta = (v_t - jnp.einsum("hkv,hk->hv", s, k_t)) * b_t[:, None]
        s = s + k_t[:, :, None] * delta[:, None, :]
        return s, jnp.einsum("hkv,hk->hv", s, q_t)

    state, out = jax.lax.scan(step, state, (q, k, v, g, beta))
    return out, state


Form = Callable[[Inputs], tuple[jax.Array, jax.Array]]

FORMS: dict[str, Form] = {
    "jnp scan (baseline)": lambda x: scan_baseline(x.q, x.k, x.v, x.g, x.beta, x.state),
    "recurrent": lambda x: recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, x.segment_ids, x.state),
    "chunked (64)": lambda x: chunked_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, x.segment_ids, x.state),
}


def best_seconds(forms: dict[str, Form], inputs: Inputs, calls: int) -> dict[str, tuple[float, np.ndarray]]:
    """Per form: its best wall seconds of one call over `calls` rounds (after a compiling call) and its outputs.
    The forms take turns within each round, so a busy spell of the machine slows them alike."""
    outs = {name: np.asarray(jax.block_until_ready(form(inputs))[0]) for name, form in forms.items()}
    best = dict.fromkeys(forms, float("inf"))
    for _ in range(calls):
        for name, form in forms.items():
            start = time.perf_counter()
            jax.block_until_ready(form(inputs))
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: (best[name], outs[name]) for name in forms}


def bench(shape: Shape, phase: str, tokens: int, reps: int) -> None:
    t = tokens if phase == "prefill" else 1
    inputs = random_inputs(shape, t, seed=0, zero_state=phase == "prefill")
    print(f"\n{phase}, {shape.name} (H={shape.heads}, Dk={shape.dk}, Dv={shape.dv}), {t} token(s) per call")
    print(f"  {'form':<22}{'ms/call':>10}{'tok/s':>12}{'vs baseline':>13}{'max |diff|':>12}")
    calls = reps if phase == "prefill" else 10 * reps
    rows = best_seconds(FORMS, inputs, calls)
    base_seconds, base_out = rows["jnp scan (baseline)"]
    for name, (seconds, out) in rows.items():
        diff = float(np.abs(out - base_out).max())
        print(f"  {name:<22}{seconds * 1e3:>10.2f}{t / seconds:>12.0f}{base_seconds / seconds:>12.2f}x{diff:>12.1e}")
    chunked, recurrent = rows["chunked (64)"][0], rows["recurrent"][0]
    print(f"  chunked / recurrent time: {chunked / recurrent:.2f}")


def paged_step(shape: Shape, lens: list[int], seed: int):
    """A step's operands (entry-point order) for sequences of ``lens`` tokens, each continuing a random row."""
    rng = np.random.default_rng(seed)
    h, dk, dv, t, n = shape.heads, shape.dk, shape.dv, sum(lens), len(lens)
    x = random_inputs(shape, t, seed, zero_state=True)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    pool = jnp.asarray(rng.standard_normal((n + 1, h, dk, dv)) * 0.1, jnp.float32)
    slots = jnp.arange(1, n + 1, dtype=jnp.int32)
    meta = (cu, jnp.asarray([n], jnp.int32), slots, jnp.zeros((n,), bool))
    return (x.q, x.k, x.v, x.g, x.beta, *meta), pool


def per_sequence_reference(args, pool):
    """Each sequence through `recurrent_gated_delta_rule` from its row (the pool untouched): [T, H, Dv]."""
    q, k, v, g, beta, cu, _, slots, _ = args
    outs = []
    for s in range(slots.shape[0]):
        a, b = int(cu[s]), int(cu[s + 1])
        seg = jnp.zeros((b - a,), jnp.int32)
        outs.append(recurrent_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], seg, pool[slots[s]])[0])
    return jnp.concatenate(outs)


def bench_paged(shape: Shape, seqs: int, tokens: int, reps: int) -> None:
    from pallas_kernels import ragged_gated_delta as rgd

    # The engine donates the pool, so the entry point updates it in place; each timed call gets a fresh copy
    # made before its clock starts (an undonated pool would add a copy of the whole pool to every call).
    entry = jax.jit(lambda p, *a: rgd.ragged_gated_delta_rule(*a, p), donate_argnums=0)
    for phase, lens in (("decode", [1] * seqs), ("mixed", [tokens] + [1] * (seqs - 1))):
        args, pool = paged_step(shape, lens, seed=1)
        t = sum(lens)
        print(f"\npaged {phase} step, {shape.name} (H={shape.heads}, Dk={shape.dk}), {len(lens)} sequences, {t} tokens")
        print(f"  {'form':<34}{'ms/call':>10}{'tok/s':>12}{'max |diff|':>12}")
        forms: dict[str, Callable] = {
            "entry point (auto: xla)": lambda p, a=args: entry(p, *a),
            "per-sequence reference": lambda p, a=args: (per_sequence_reference(a, p),),
        }
        ref = np.asarray(forms["per-sequence reference"](pool)[0])
        best = dict.fromkeys(forms, float("inf"))
        outs = {name: np.asarray(jax.block_until_ready(f(pool + 0)[0])) for name, f in forms.items()}
        for _ in range(reps):
            for name, f in forms.items():
                fresh_pool = jax.block_until_ready(pool + 0)
                start = time.perf_counter()
                jax.block_until_ready(f(fresh_pool))
                best[name] = min(best[name], time.perf_counter() - start)
        for name in forms:
            diff = float(np.abs(outs[name] - ref).max())
            print(f"  {name:<34}{best[name] * 1e3:>10.2f}{t / best[name]:>12.0f}{diff:>12.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="prefill tokens per call")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per figure (the best is kept)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--paged", action="store_true", help="time the paged step's entry point (docstring)")
    parser.add_argument("--seqs", type=int, default=64, help="sequences of a paged step")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.devices()[0].device_kind}")
    if args.paged:
        for name in args.shapes:
            bench_paged(SHAPES[name], args.seqs, args.tokens, args.reps)
        return
    for name in args.shapes:
        for phase in ("prefill", "decode"):
            bench(SHAPES[name], phase, args.tokens, args.reps)


if __name__ == "__main__":
    main()
