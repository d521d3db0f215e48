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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="prefill tokens per call")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per figure (the best is kept)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.devices()[0].device_kind}")
    for name in args.shapes:
        for phase in ("prefill", "decode"):
            bench(SHAPES[name], phase, args.tokens, args.reps)


if __name__ == "__main__":
    main()
