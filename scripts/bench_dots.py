"""The weight dots of a decode step on CPU: XLA's default (YNNPACK) against oneDNN, beside the machine's peak.

Most of a CPU decode step's time is its weight matmuls at a few rows (the batch's tokens): `profile_decode.py`
and `perf` put 55-57 % of the engine's CPU in XLA's YNNPACK dot kernels on the peers' 56M model. This script
times exactly those dots, as the model runs them (`paged_jax.model.quant.dot` on the model's own weights, every
layer's weight in turn so that they come from memory as in a step), at `--rows` rows, in float32 and bfloat16,
compiled with XLA's default dots and with oneDNN's (`xla_flags.ONEDNN_DOT_OPTIONS`, what `PAGED_JAX_ONEDNN=1`
gives the forward step), the two alternating round by round. Per weight kind: median CPU ms and best wall ms
per dot, GFLOP/s (wall), the weights' GB/s, and default / oneDNN CPU time. Beside them a 2048^3 float32 matmul,
the machine's compute peak through the same compiler, and the lines say what one decode step's dots cost.

    .venv/bin/python scripts/bench_dots.py [--model /tmp/paged_jax_peers/model|NAME] [--rows 32] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paged_jax.engine.load import load_model  # noqa: E402
from paged_jax.model import quant  # noqa: E402
from paged_jax.worker import xla_flags  # noqa: E402

# The weight kinds of a Llama-style layer and the axes each contracts (as paged_jax.model.layers calls them).
LAYER_WEIGHTS = (
    ("self_attn", "qkv_proj", 1),
    ("self_attn", "o_proj", 2),
    ("mlp", "gate_up_proj", 1),
    ("mlp", "down_proj", 1),
)


def timed(fn, x, weights, rounds: int) -> tuple[list[float], list[float]]:
    """Per round: CPU seconds and wall seconds per dot, over one call per weight."""
    fn(x, weights[0]).block_until_ready()
    cpu, wall = [], []
    for _ in range(rounds):
        c, w = time.process_time(), time.perf_counter()
        for weight in weights:
            y = fn(x, weight)
        y.block_until_ready()
        cpu.append((time.process_time() - c) / len(weights))
        wall.append((time.perf_counter() - w) / len(weights))
    return cpu, wall


def weight_sets(params) -> dict[str, tuple[list[jax.Array], int]]:
    """Weight kind -> (every layer's weight, contracted axes); the LM head (or tied embedding) as [H, V]."""
    p = params["params"]
    layers = sorted((k for k in p if k.startswith("layers_")), key=lambda k: int(k.split("_")[1]))
    sets = {name: ([p[layer][block][name] for layer in layers], contract) for block, name, contract in LAYER_WEIGHTS}
    head = p["lm_head"] if "lm_head" in p else p["embed_tokens"]["embedding"].T
    sets["lm_head"] = ([head], 1)
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
    _, wall = timed(mm, a, [a], args.rounds)
    peak = 2 * n**3 / min(wall) / 1e9
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
        for name, (weights, contract) in weight_sets(params).items():
            k_shape = weights[0].shape[:contract]
            k, n_out = int(np.prod(k_shape)), int(np.prod(weights[0].shape[contract:]))
            x = jnp.asarray(np.random.default_rng(1).standard_normal((args.rows, *k_shape)), dtype)
            lowered = jax.jit(lambda x, w, c=contract: quant.dot(x, w, c)).lower(x, weights[0])
            fns = {
                "default": lowered.compile(),
                "onednn": lowered.compile(compiler_options=xla_flags.ONEDNN_DOT_OPTIONS),
            }
            runs = {key: ([], []) for key in fns}
            for _ in range(args.rounds):  # the two alternate, one round at a time
                for key, fn in fns.items():
                    cpu, wall = timed(fn, x, weights, 1)
                    runs[key][0].extend(cpu)
                    runs[key][1].extend(wall)
            flops = 2 * args.rows * k * n_out
            cells = []
            for key in fns:
                cpu, wall = float(np.median(runs[key][0])), min(runs[key][1])
                step[key] += cpu * (config.num_layers if name != "lm_head" else 1)
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
