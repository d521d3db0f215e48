"""The weight dots of a decode step on CPU: XLA's default (YNNPACK), oneDNN and the packed-weight GEMM, against
the machine's peak.

Most of a CPU decode step's time is its weight matmuls at a few rows (the batch's tokens): `profile_decode.py`
and `perf` put 55-57 % of the engine's CPU in XLA's YNNPACK dot kernels on the peers' 56M model. This script
times exactly those dots, as the model runs them (`paged_jax.model.quant.dot` on the model's own weights, every
layer's weight in turn so that they come from memory as in a step; the LM head is the model's own
`compute_logits`, tied or not), at `--rows` rows, in float32 and bfloat16, compiled with XLA's default dots, with
oneDNN's (`xla_flags.ONEDNN_DOT_OPTIONS`, what `PAGED_JAX_ONEDNN=1` gives the forward step) and as the packed
GEMM (`pallas_kernels.cpu.gemm`, the same weights packed once), the three alternating round by round. Per weight
kind: median CPU ms per dot and its percent of peak (CPU time, so other load on a shared machine lowers it
little), best wall ms and GFLOP/s (wall), the weights' GB/s, the packed GEMM's % of peak in its best round (the
least disturbed by other load on a shared machine) and default / packed CPU time.

w8a8 (float32 activations quantized per token, int8 x int8 -> int32, rescaled: `paged_jax.model.quant.dot` on
`quantize_params(..., "w8a8")` weights): XLA's int8 dot against the packed int8 GEMM (the weights packed by
`paged_jax.model.cpu_weights.pack_params`, VNNI where the CPU has it), both with the quantization and rescale the
model runs; "% peak" against the int8 peak (`gemm.peak_gflops_per_core(int8=True)`, giga integer operations).

Peak: measured, a register-only FMA loop of the GEMM library (`gemm.peak_gflops_per_core`: the native path's
vector FMA, `vdpbf16ps` for bfloat16 where the CPU has AVX-512 BF16), per core; "% peak" is GFLOP per CPU-second
over that per-core peak. Beside it, a 2048^3 float32 matmul through XLA (wall, all cores).

Roofline: a dot of R rows does 2 R / itemsize FLOP per weight byte, and in a step its weight streams from memory
(a model's layers do not fit the caches), so per core it cannot beat min(peak, read GB/s x 2 R / itemsize), the
read rate measured by `gemm.read_gbs_per_core` (every core streaming its own buffer at once, per CPU-second);
the header prints that bound per dtype: where it is below the peak, "% peak" cannot reach 100.

    python -m scripts.bench.bench_dots [--model DIR|JSON|NAME] [--rows 32] [--rounds 7] [--hot] [--only w8a8]

`--hot`: every call on layer 0's weight, so it stays in cache (L2/L3): the dots' compute ceiling, without the
memory stream of a real step.

Default model: the HF directory /tmp/paged_jax_peers/model if present, else the peers' 56M Llama config
(random weights, `bench_cpu_step.PEER_56M`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from paged_jax.engine.load import load_model  # noqa: E402
from paged_jax.model import cpu_weights, quant  # noqa: E402
from paged_jax.worker import xla_flags  # noqa: E402
from paged_jax.worker.step_functions import StepKey, step_functions  # noqa: E402
from pallas_kernels.cpu import gemm  # noqa: E402
from scripts.bench.bench_cpu_step import PEER_56M  # noqa: E402

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
    """One weight kind's dot: fn(x [rows, *k_shape], weight, onednn) -> [rows, n], every layer's weight, and each
    as a [K, N] matrix (what the packed GEMM packs)."""

    fn: Callable
    weights: list
    k_shape: tuple[int, ...]
    n: int
    matrices: list


def dot_sets(config, params) -> dict[str, Dot]:
    """Weight kind -> its Dot. The LM head is the model's `compute_logits` (its weight the whole params; the
    logits rounded to the dtype under oneDNN, as the runner's step does)."""
    p = params["params"]
    layers = sorted((k for k in p if k.startswith("layers_")), key=lambda k: int(k.split("_")[1]))
    sets = {}
    for block, name, contract in LAYER_WEIGHTS:
        w = [p[layer][block][name] for layer in layers]
        fn = functools.partial(lambda x, w, onednn, c: quant.dot(x, w, c), c=contract)
        k, n = int(np.prod(w[0].shape[:contract])), int(np.prod(w[0].shape[contract:]))
        sets[name] = Dot(fn, w, w[0].shape[:contract], n, [x.reshape(k, n) for x in w])
    model, _ = step_functions(StepKey(config, "auto"))

    def logits(x, params, onednn):
        return model.apply(params, x, round_to_dtype=onednn, method="compute_logits")

    head = p["embed_tokens"]["embedding"].T if config.tie_word_embeddings else p["lm_head"]
    sets["lm_head"] = Dot(logits, [params], (config.hidden_size,), config.vocab_size, [head])
    return sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory, config JSON or name (default: see above)")
    ap.add_argument("--rows", type=int, default=32, help="rows of each dot (a decode step's tokens)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--hot", action="store_true", help="every call on layer 0's weight (cache-resident: the compute ceiling)"
    )
    ap.add_argument("--only", choices=("w8a8",), default=None, help="run only the w8a8 table")
    args = ap.parse_args()
    model = args.model
    if model is None:
        model = "/tmp/paged_jax_peers/model"
        if not Path(model).exists():
            model = str(Path(tempfile.mkdtemp()) / "peer-56m.json")
            Path(model).write_text(json.dumps(PEER_56M))

    lib = gemm.kernel()
    if lib is None:
        raise SystemExit("the packed CPU GEMM cannot be built here")
    if args.only == "w8a8":
        print(f"jax {jax.__version__}; {os.cpu_count()} CPUs; ISA {lib.isa}; load average {os.getloadavg()}")
        w8a8_rows(model, args.rows, args.rounds, args.hot)
        print(f"load average after: {os.getloadavg()}")
        return
    peaks = {dt: gemm.peak_gflops_per_core(bfloat16=dt == jnp.bfloat16) for dt in (jnp.float32, jnp.bfloat16)}
    read_gbs = gemm.read_gbs_per_core()
    n = 2048
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, a).block_until_ready()
    big = 2 * n**3 / min(timed(mm, a, [a])[1] for _ in range(args.rounds)) / 1e9
    print(
        f"jax {jax.__version__}; {os.cpu_count()} CPUs; ISA {lib.isa} (panels of {lib.nr}); load average "
        f"{os.getloadavg()}; measured peak per core (register-only FMA loop): float32 {peaks[jnp.float32]:.0f}, "
        f"bfloat16 {peaks[jnp.bfloat16]:.0f} GFLOP/s; float32 matmul {n}^3 via XLA: {big:.0f} GFLOP/s wall; "
        f"memory read {read_gbs:.1f} GB per CPU-s per core (all cores streaming)"
    )
    roofs = {dt: min(peaks[dt], read_gbs * 2 * args.rows / jnp.dtype(dt).itemsize) for dt in peaks}
    print(
        f"roofline at {args.rows} rows, weights from memory: float32 {roofs[jnp.float32]:.0f} "
        f"({100 * roofs[jnp.float32] / peaks[jnp.float32]:.0f} % of peak), bfloat16 {roofs[jnp.bfloat16]:.0f} "
        f"({100 * roofs[jnp.bfloat16] / peaks[jnp.bfloat16]:.0f} %) GFLOP per CPU-s per core"
    )
    print(f"model {model}, {args.rows} rows; per dot: median CPU ms and % of peak, best wall ms; each layer's weight")
    cols = ("default", "onednn", "packed")
    header = f"{'dtype':9s} {'weight':13s} {'K x N':>13s}" + "".join(
        f" {c + ' CPU ms':>15s} {'%peak':>6s} {'wall':>6s} {'GF/s':>5s}" for c in cols
    )
    print(f"{header} {'GB/s(pk)':>8s} {'pk best':>7s} {'default/packed':>14s}")
    for dtype in (jnp.float32, jnp.bfloat16):
        config, params, _ = load_model(model, dtype=jnp.dtype(dtype).name)
        step = dict.fromkeys(cols, 0.0)
        for name, dot in dot_sets(config, params).items():
            fn, weights, k, n_out = dot.fn, dot.weights, int(np.prod(dot.k_shape)), dot.n
            x = jnp.asarray(np.random.default_rng(1).standard_normal((args.rows, *dot.k_shape)), dtype)
            out_dtype = jnp.float32 if name == "lm_head" else dtype  # logits are float32, as compute_logits'
            if args.hot:
                weights, dot = [weights[0]] * len(weights), dataclasses.replace(dot, matrices=dot.matrices[:1])
            packed = [gemm.pack(m, lib.nr) for m in dot.matrices] * (len(weights) if args.hot else 1)
            fns = {
                "default": (jax.jit(lambda x, w, f=fn: f(x, w, False)).lower(x, weights[0]).compile(), weights),
                "onednn": (
                    jax.jit(lambda x, w, f=fn: f(x, w, True))
                    .lower(x, weights[0])
                    .compile(compiler_options=xla_flags.ONEDNN_DOT_OPTIONS),
                    weights,
                ),
                "packed": (
                    jax.jit(lambda x, w, o=out_dtype: gemm.matmul(x.reshape(x.shape[0], -1), w, out_dtype=o)),
                    packed,
                ),
            }
            runs = {key: ([], []) for key in fns}
            results = {key: np.asarray(f(x, ws[0]), np.float32).reshape(args.rows, -1) for key, (f, ws) in fns.items()}
            scale = float(np.max(np.abs(results["default"])))
            err = float(np.max(np.abs(results["packed"] - results["default"]))) / scale
            for _ in range(args.rounds):  # the three alternate, one round at a time
                for key, (f, ws) in fns.items():
                    cpu, wall = timed(f, x, ws)
                    runs[key][0].append(cpu)
                    runs[key][1].append(wall)
            flops = 2 * args.rows * k * n_out
            row = f"{jnp.dtype(dtype).name:9s} {name:13s} {f'{k} x {n_out}':>13s}"
            for key in cols:
                cpu, wall = float(np.median(runs[key][0])), min(runs[key][1])
                step[key] += cpu * len(weights)  # one call per layer, one LM head
                pct = 100 * flops / cpu / 1e9 / peaks[dtype]
                row += f" {cpu * 1e3:15.3f} {pct:5.0f}% {wall * 1e3:6.2f} {flops / wall / 1e9:5.0f}"
            gbs = k * n_out * jnp.dtype(dtype).itemsize / min(runs["packed"][1]) / 1e9
            ratio = np.median(runs["default"][0]) / np.median(runs["packed"][0])
            best = 100 * flops / min(runs["packed"][0]) / 1e9 / peaks[dtype]  # the least disturbed round
            print(f"{row} {gbs:8.1f} {best:6.0f}% {ratio:13.2f}x  (packed vs default: max rel. diff {err:.1e})")
        print(
            f"  one decode step's weight dots ({config.num_layers} layers + LM head), CPU ms: "
            + ", ".join(f"{key} {step[key] * 1e3:.1f}" for key in cols)
        )
    w8a8_rows(model, args.rows, args.rounds, args.hot)
    print(f"load average after: {os.getloadavg()}")


def w8a8_rows(model: str, rows: int, rounds: int, hot: bool) -> None:
    """The w8a8 table: per weight kind, XLA's int8 dot ("xla") against the packed int8 GEMM ("packed"), median CPU
    ms and % of the int8 peak, and their ratio; then one step's sum."""
    peak = gemm.peak_gflops_per_core(int8=True)
    lib = gemm.kernel()
    print(
        f"w8a8 (int8 x int8 -> int32, VNNI {lib.vnni}): int8 peak per core {peak:.0f} Gop/s; median CPU ms and % "
        "of it, best wall ms"
    )
    config, params, _ = load_model(model, dtype="float32")
    qparams = quant.quantize_params(params, "w8a8")
    packed, _ = cpu_weights.pack_params(qparams, config)
    p, rec = qparams["params"], packed[cpu_weights.CPU_WEIGHTS]
    layers = sorted((k for k in p if k.startswith("layers_")), key=lambda k: int(k.split("_")[1]))
    kinds = [
        (name, [p[i][b][name] for i in layers], [rec[i][b][name] for i in layers], c) for b, name, c in LAYER_WEIGHTS
    ]
    if "lm_head" in rec and rec["lm_head"].scale is not None:
        kinds.append(("lm_head", [p["lm_head"]], [rec["lm_head"]], 1))
    step = {"xla": 0.0, "packed": 0.0}
    for name, qws, cws, contract in kinds:
        if hot:
            qws, cws = [qws[0]] * len(qws), [cws[0]] * len(cws)
        k_shape = qws[0].shape[:contract]
        k, n_out = int(np.prod(k_shape)), int(np.prod(qws[0].shape[contract:]))
        x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, *k_shape)), jnp.float32)
        fn = jax.jit(lambda x, w, c=contract: quant.dot(x, w, c))
        fns = {"xla": (fn, qws), "packed": (fn, cws)}
        same = bool(np.array_equal(np.asarray(fn(x, qws[0])), np.asarray(fn(x, cws[0]))))
        runs: dict[str, tuple[list[float], list[float]]] = {key: ([], []) for key in fns}
        for _ in range(rounds):
            for key, (f, ws) in fns.items():
                cpu, wall = timed(f, x, ws)
                runs[key][0].append(cpu)
                runs[key][1].append(wall)
        ops = 2 * rows * k * n_out
        row = f"w8a8      {name:13s} {f'{k} x {n_out}':>13s}"
        for key in fns:
            cpu, wall = float(np.median(runs[key][0])), min(runs[key][1])
            step[key] += cpu * len(qws)
            row += f" {key} {cpu * 1e3:8.3f} ms {100 * ops / cpu / 1e9 / peak:4.0f}% {wall * 1e3:6.2f}"
        ratio = np.median(runs["xla"][0]) / np.median(runs["packed"][0])
        print(f"{row}  xla/packed {ratio:.2f}x  (results identical: {same})")
    print(
        f"  one decode step's w8a8 weight dots ({config.num_layers} layers + LM head), CPU ms: "
        + ", ".join(f"{key} {v * 1e3:.1f}" for key, v in step.items())
    )


if __name__ == "__main__":
    main()
