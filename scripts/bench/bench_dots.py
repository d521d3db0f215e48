"""The weight dots of a decode step on CPU: XLA's default (YNNPACK) against oneDNN, beside the machine's peak.

Most of a CPU decode step's time is its weight matmuls at a few rows (the batch's tokens): `profile_decode.py`
and `perf` put 55-57 % of the engine's CPU in XLA's YNNPACK dot kernels on the peers' 56M model. This script
times exactly those dots, as the model runs them (`paged_jax.model.quant.dot` on the model's own weights, every
layer's weight in turn so that they come from memory as in a step; the LM head is the model's own
`compute_logits`, tied or not), at `--rows` rows, in float32 and bfloat16,
compiled with XLA's default dots and with oneDNN's (`xla_flags.ONEDNN_DOT_OPTIONS`, what `PAGED_JAX_ONEDNN=1`
gives the forward step), the two alternating round by round. Per weight kind: median CPU ms and best wall ms
per dot, GFLOP/s (wall), the weights' GB/s, and default / oneDNN CPU time. Beside them a 2048^3 float32 matmul,
the machine's compute peak through the same compiler, and the lines say what one decode step's dots cost.

    .venv/bin/python scripts/bench/bench_dots.py [--model /tmp/paged_jax_peers/model|NAME] [--rows 32] [--rounds 7]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from paged_jax.engine.load import load_model  # noqa: E402
from paged_jax.model import quant  # noqa: E402
from paged_jax.worker import xla_flags  # noqa: E402
from paged_jax.worker.step_functions import StepKey, step_functions  # noqa: E402

# The weight kinds of a Llama-style layer and the axes each contracts (as paged_jax.model.layers calls them).
LAYER_WEIGHTS = (
    ("self_attn", "qkv_proj", 1),
    ("self_attn", "o_proj", 2),
    ("mlp", "gate_up_proj", 1),
    ("mlp", "down_proj", 1),
)


def timed(fn, x, weights) -> tuple[float, float]:
    """CPU seconds and wall seconds per dot, over one call per weight (`fn` already warm)."""
    c, w = time.process_time(), time.perf_counter()
    for weight in weights:
        y = fn(x, weight)
    y.block_until_ready()
    return (time.process_time() - c) / len(weights), (time.perf_counter() - w) / len(weights)


@dataclasses.dataclass(frozen=True)
class Dot:
    """One weight kind's dot: fn(x [rows, *k_shape], weight, onednn) -> [rows, n], and every layer's weight."""

    fn: Callable
    weights: list
    k_shape: tuple[int, ...]
    n: int


def dot_sets(config, params) -> dict[str, Dot]:
    """Weight kind -> its Dot. The LM head is the model's `compute_logits` (its weight the whole params; the
    logits rounded to the dtype under oneDNN, as the runner's step does)."""
    p = params["params"]
    layers = sorted((k for k in p if k.startswith("layers_")), key=lambda k: int(k.split("_")[1]))
    sets = {}
    for block, name, contract in LAYER_WEIGHTS:
        w = [p[layer][block][name] for layer in layers]
        fn = functools.partial(lambda x, w, onednn, c: quant.dot(x, w, c), c=contract)
        sets[name] = Dot(fn, w, w[0].shape[:contract], int(np.prod(w[0].shape[contract:])))
    model, _ = step_functions(StepKey(config, "auto"))

    def logits(x, params, onednn):
        return model.apply(params, x, round_to_dtype=onednn, method="compute_logits")

    sets["lm_head"] = Dot(logits, [params], (config.hidden_size,), config.vocab_size)
    return sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/paged_jax_peers/model", help="HF directory or config name")
    ap.add_argument("--rows", type=int, default=32, help="rows of each dot (a decode step's tokens)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    n = 2048
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, a).block_until_ready()
    peak = 2 * n**3 / min(timed(mm, a, [a])[1] for _ in range(args.rounds)) / 1e9
    print(
        f"jax {jax.__version__}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}; "
        f"float32 matmul {n}^3: {peak:.0f} GFLOP/s wall (the compute peak these dots are measured against)"
    )
    print(f"model {args.model}, {args.rows} rows; per dot: median CPU ms, best wall ms; each layer's weight in turn")
    header = (
        f"{'dtype':9s} {'weight':13s} {'K x N':>13s} {'default CPU':>11s} {'wall':>7s} {'GFLOP/s':>7s} "
        f"{'GB/s':>6s} {'oneDNN CPU':>10s} {'wall':>7s} {'GFLOP/s':>7s} {'default/oneDNN CPU':>18s}"
    )
    for dtype in (jnp.float32, jnp.bfloat16):
        config, params, _ = load_model(args.model, dtype=jnp.dtype(dtype).name)
        print(header)
        step = {"default": 0.0, "onednn": 0.0}
        for name, dot in dot_sets(config, params).items():
            fn, weights, k, n_out = dot.fn, dot.weights, int(np.prod(dot.k_shape)), dot.n
            x = jnp.asarray(np.random.default_rng(1).standard_normal((args.rows, *dot.k_shape)), dtype)
            fns = {
                "default": jax.jit(lambda x, w, f=fn: f(x, w, False)).lower(x, weights[0]).compile(),
                "onednn": jax.jit(lambda x, w, f=fn: f(x, w, True))
                .lower(x, weights[0])
                .compile(compiler_options=xla_flags.ONEDNN_DOT_OPTIONS),
            }
            runs = {key: ([], []) for key in fns}
            for f in fns.values():
                f(x, weights[0]).block_until_ready()
            for _ in range(args.rounds):  # the two alternate, one round at a time
                for key, f in fns.items():
                    cpu, wall = timed(f, x, weights)
                    runs[key][0].append(cpu)
                    runs[key][1].append(wall)
            flops = 2 * args.rows * k * n_out
            cells = []
            for key in fns:
                cpu, wall = float(np.median(runs[key][0])), min(runs[key][1])
                step[key] += cpu * len(weights)  # one call per layer, one LM head
                cells.append((cpu, wall, flops / wall / 1e9))
            (dc, dw, dg), (oc, ow, og) = cells
            gbs = k * n_out * jnp.dtype(dtype).itemsize / dw / 1e9
            print(
                f"{jnp.dtype(dtype).name:9s} {name:13s} {f'{k} x {n_out}':>13s} {dc * 1e3:11.2f} {dw * 1e3:7.2f} "
                f"{dg:7.0f} {gbs:6.1f} {oc * 1e3:10.2f} {ow * 1e3:7.2f} {og:7.0f} {dc / oc:17.2f}x"
            )
        print(
            f"  one decode step's weight dots ({config.num_layers} layers + LM head), CPU ms: default "
            f"{step['default'] * 1e3:.1f}, oneDNN {step['onednn'] * 1e3:.1f}"
        )


if __name__ == "__main__":
    main()
