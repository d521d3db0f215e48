"""The CPU decode step scanned (`--scan-layers on`) against unrolled (`auto` on CPU), side by side in one process.

Why: a scanned decoder on XLA:CPU copies every layer's weight slices out of the stacked arrays before its dots on
every step (`paged_jax.model.scan.use_scan`); this is the before/after of making "auto" unroll on CPU.

Per engine (the peers' 56M Llama in float32 by default: hidden 512, 8 layers, vocabulary 32,000, random weights):

- the compiled decode step's weight copies (`paged_jax.worker.hlo_audit.weight_copies` with the matrix forms),
  MiB per step, from the HLO: deterministic;
- the peers' workload shape: `--batch` prompts of `--prompt-len` random ids, `--max-tokens` greedy new tokens
  with EOS ignored, one untimed run each to compile, then `--rounds` runs alternating the engines (the order
  flipped every round, so load drift on a shared machine falls on both): generated tokens per wall second and
  per CPU second (this process's, all threads: on loaded cores it moves far less with other work than wall);
- greedy tokens of the two engines compared, and the wall time of each engine's first run (its compiles
  included: what unrolling costs at start-up);
- the jitted forward step alone (the runner's `step_functions`, scanned and unrolled) on one decode batch of
  `--batch` sequences at `--prompt-len + --max-tokens` keys, rounds alternating: median wall and CPU ms per step,
  the logits of both compared for equality;
- the sampler of a plain greedy batch (the rows and vocabulary of the decode step) with the all-ones bitmask
  the runner passes when no row is constrained and without any, beside the forward step: median CPU ms of
  `--reps` calls, what the structured-output operand costs a step that does not use it.

    python -m scripts.bench.bench_cpu_step  # or: python scripts/bench/bench_cpu_step.py [--model DIR|JSON]
        [--dtype float32] [--batch 32] [--prompt-len 128] [--max-tokens 64] [--rounds 4] [--reps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import LLM, SamplingParams
from paged_jax.engine.aot import step_job
from paged_jax.engine.load import load_model
from paged_jax.model.cpu_weights import CPU_WEIGHTS
from paged_jax.model.scan import LAYERS, stack_layers
from paged_jax.structured.bitmask import all_allowed
from paged_jax.worker.hlo_audit import weight_copies, with_matrix_forms
from paged_jax.worker.paged_attention import PagedMeta
from paged_jax.worker.runner import ModelRunner
from paged_jax.worker.sampler import SamplingMeta, empty_meta, sample
from paged_jax.worker.step_functions import StepKey, step_functions
from pallas_kernels.common import kv_pages_shape

PEER_56M = {  # /work/shared/peers/make_model.py's LlamaConfig
    "name": "peer-56m",
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_layers": 8,
    "num_heads": 8,
    "num_kv_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "dtype": "float32",
    "bos_token_id": 1,
    "eos_token_ids": [2],
}
MODES = ("on", "auto")  # before (scanned on CPU) and after (auto: unrolled on CPU)


def decode_weight_copies_mib(runner: ModelRunner) -> float:
    """MiB of layer weights the runner's compiled decode step copies per step."""
    tree = runner.params["params"]
    leaves = jax.tree.leaves(tree[LAYERS] if runner.scan else tree["layers_0"])
    leaves += jax.tree.leaves(runner.params.get(CPU_WEIGHTS, {}).get("layers_0", {}))  # packed for the CPU GEMM
    shapes = with_matrix_forms([(tuple(x.shape[1:] if runner.scan else x.shape), np.dtype(x.dtype)) for x in leaves])
    hlo = step_job(runner, "decode").lower().compile().as_text()
    return weight_copies(hlo, shapes, runner.config.num_layers).hbm_bytes / 2**20


def median_cpu_ms(fn, reps: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        c0 = time.process_time()
        jax.block_until_ready(fn())
        times.append(time.process_time() - c0)
    return float(np.median(times)) * 1e3


def sampler_rows(batch: int, vocab: int, reps: int) -> list[tuple[str, float]]:
    """Median CPU ms of the greedy sampler on [batch, vocab] logits, with the all-ones bitmask and without."""
    logits = jax.random.normal(jax.random.key(0), (batch, vocab))
    meta = SamplingMeta(**{k: jax.numpy.asarray(v) for k, v in empty_meta(batch).items()})
    mask = jax.numpy.asarray(all_allowed(batch, vocab))
    flags = dict(do_sample=False, do_filter=False, do_penalty=False, want_logprobs=False)
    with_mask = jax.jit(lambda lg, m, b: sample(lg, m, b, **flags))
    without = jax.jit(lambda lg, m: sample(lg, m, None, **flags))
    return [
        ("greedy sampler, all-ones bitmask (as run)", median_cpu_ms(lambda: with_mask(logits, meta, mask), reps)),
        ("greedy sampler, no bitmask", median_cpu_ms(lambda: without(logits, meta), reps)),
    ]


def forward_steps(model: str, dtype: str, batch: int, context: int, rounds: int) -> dict[bool, tuple[float, float]]:
    """The jitted forward step alone (all layers + LM head, the runner's own `step_functions`), scanned and
    unrolled, on one decode batch: `batch` sequences of `context` keys on scattered pages. Rounds of 5 steps
    alternate (order flipped each round); per variant (median wall ms, median CPU ms) per step. Also checks that
    both give the same logits."""
    config, params, _ = load_model(model, dtype=dtype)
    rng = np.random.default_rng(0)
    blocks, page = -(-(context + 1) // 16), 16
    num_pages = batch * blocks + 1
    tables = rng.permutation(np.arange(1, num_pages, dtype=np.int32)).reshape(batch, blocks)
    pos = np.full(batch, context, np.int32)
    slots = tables[np.arange(batch), pos // page] * page + pos % page
    meta = PagedMeta(
        jnp.asarray(slots),
        jnp.asarray(pos + 1),
        jnp.asarray(tables),
        jnp.arange(batch + 1, dtype=jnp.int32),
        jnp.asarray([batch], jnp.int32),
    )
    shape = kv_pages_shape(num_pages, config.num_kv_heads, page, config.head_dim)
    layers = [rng.standard_normal(shape, np.float32) * 0.5 for _ in range(config.num_layers)]
    tokens, positions = jnp.asarray(rng.integers(3, config.vocab_size, batch), jnp.int32), jnp.asarray(pos)
    rows, steps, logits = jnp.arange(batch, dtype=jnp.int32), {}, {}
    for scan in (True, False):
        _, fwd = step_functions(StepKey(config, "auto", scan=scan))
        p = stack_layers(params) if scan else params
        dt = jnp.dtype(config.dtype)
        kv = jnp.asarray(np.concatenate(layers), dt) if scan else tuple(jnp.asarray(x, dt) for x in layers)
        state = {"kv": kv}  # layer l's page p at l * num_pages + p when stacked

        def step(fwd=fwd, p=p, state=state):
            out, state["kv"], _ = fwd(p, state["kv"], tokens, positions, meta, rows)
            return out

        logits[scan], steps[scan] = np.asarray(step()), step
    assert np.array_equal(logits[True], logits[False]), "scanned and unrolled logits differ"
    walls: dict[bool, list[float]] = {True: [], False: []}
    cpus: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for scan in (True, False) if r % 2 == 0 else (False, True):
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(5):
                jax.block_until_ready(steps[scan]())
            walls[scan].append((time.perf_counter() - t0) / 5 * 1e3)
            cpus[scan].append((time.process_time() - c0) / 5 * 1e3)
    return {s: (float(np.median(walls[s])), float(np.median(cpus[s]))) for s in (True, False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model (config name, JSON, HF dir); default: the peers' 56M Llama")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    model = args.model
    if model is None:
        model = str(Path(tempfile.mkdtemp()) / "peer-56m.json")
        Path(model).write_text(json.dumps(PEER_56M))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__}")
    print(f"load average before: {os.getloadavg()}")
    llms = {
        m: LLM(
            model,
            dtype=args.dtype,
            max_model_len=args.prompt_len + args.max_tokens + 16,
            max_num_seqs=args.batch,
            max_num_batched_tokens=1024,
            num_pages=args.batch * (-(-(args.prompt_len + args.max_tokens + 16) // 16)) + 1,
            warmup=False,
            scan_layers=m,
        )
        for m in MODES
    }
    copies = {m: decode_weight_copies_mib(llm.engine.runner) for m, llm in llms.items()}
    vocab = llms["auto"].config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, args.prompt_len).tolist()} for _ in range(args.batch)]
    sp = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens, ignore_eos=True, detokenize=False
    )
    tokens, first = {}, {}
    for m, llm in llms.items():  # the first run compiles each step shape it meets
        t0 = time.perf_counter()
        tokens[m] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        first[m] = time.perf_counter() - t0
    rates: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for m in MODES if r % 2 == 0 else MODES[::-1]:
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llms[m].generate(prompts, sp, use_tqdm=False)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            gen = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[m].append((gen / wall, gen / cpu))
            print(f"round {r} scan_layers={m}: {gen / wall:.1f} tok/s wall, {gen / cpu:.1f} tok per CPU-s", flush=True)
    med = {m: (float(np.median([w for w, _ in rates[m]])), float(np.median([c for _, c in rates[m]]))) for m in MODES}
    head = f"{'scan_layers':<12} {'scan':>5} {'w-copy MiB/step':>16} {'tok/s wall':>11} {'tok/CPU-s':>10}"
    print(f"\n{head} {'first run s':>12}")
    for m in MODES:
        row = f"{m:<12} {llms[m].engine.runner.scan!s:>5} {copies[m]:>16.1f} {med[m][0]:>11.1f} {med[m][1]:>10.1f}"
        print(f"{row} {first[m]:>12.1f}")
    a, b = med["on"], med["auto"]
    print(f"auto / on: {b[0] / a[0]:.2f}x wall, {b[1] / a[1]:.2f}x per CPU-s (medians of {args.rounds} rounds)")
    print(f"greedy tokens equal: {tokens['on'] == tokens['auto']}")
    print(f"\nper-step work of a plain greedy batch ({args.batch} rows x {vocab}), median CPU ms of {args.reps}:")
    for name, ms in sampler_rows(args.batch, vocab, args.reps):
        print(f"  {name:<44} {ms:7.2f}")
    step_ms = 1e3 * args.batch / b[1]
    print(f"  {'a whole step: batch / tok per CPU-s (auto)':<44} {step_ms:7.2f}")
    fwd = forward_steps(model, args.dtype, args.batch, args.prompt_len + args.max_tokens, 4 * args.rounds)
    print(f"\nforward step alone, {args.batch} decode rows (median of {4 * args.rounds} rounds of 5; same logits):")
    for scan, (wall, cpu) in fwd.items():
        print(f"  {'scanned' if scan else 'unrolled':<9} {wall:7.1f} wall ms {cpu:7.1f} CPU ms")
    print(f"  scanned / unrolled: {fwd[True][0] / fwd[False][0]:.2f}x wall, {fwd[True][1] / fwd[False][1]:.2f}x CPU")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
