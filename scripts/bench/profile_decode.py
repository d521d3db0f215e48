"""Where does a decode step's time go? Per-op times of one batch-32 decode step, as a table.

The whole step is the runner's own jitted forward (`runner.step_functions`) plus the sampler; each part is the
same code (the model's own projection functions, `apply_rope`, `write_kv`, the XLA paged attention, `sample`)
jitted on its own over all layers at once (one dispatch per part, like the step), on the shapes of the peers'
workload: 32 sequences, each at `--context` tokens of KV (default 192: prompt 128 + half of 128 new tokens),
pages scattered over the cache as the KV manager leaves them. Each part: fastest wall time and median CPU time
of `--reps` calls (`timeit`). The step and every part are compiled with the compiler options the runner gives
that step (`xla_flags.forward_compiler_options`: oneDNN's AMX dots for a bfloat16 model's steps of at least
`ONEDNN_MIN_TOKENS` tokens on an AMX CPU), so the table is the engine's own step; `PAGED_JAX_ONEDNN=0` shows XLA's
default dots.
A trivial jitted op gives the dispatch floor included in each part's time; with `--engine`, a real engine run's
decode steps: wall time, the main thread's CPU time (scheduling, metadata, launches: the host's own work) and
the wall time blocked collecting the samples.

    python scripts/bench/profile_decode.py [--model DIR|name] [--dtype float32|bfloat16] [--batch 32] [--engine]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]

import pallas_kernels  # noqa: E402
from paged_jax.engine.load import load_model  # noqa: E402
from paged_jax.model import layers  # noqa: E402
from paged_jax.worker import xla_flags  # noqa: E402
from paged_jax.worker.paged_attention import PagedMeta  # noqa: E402
from paged_jax.worker.sampler import SamplingMeta, empty_meta, sample  # noqa: E402
from paged_jax.worker.step_functions import StepKey, step_functions  # noqa: E402
from pallas_kernels.common import kv_pages_shape  # noqa: E402


def timeit(fn: Callable, *args, reps: int) -> tuple[float, float]:
    """(fastest wall ms, median CPU ms) of `reps` calls of `fn(*args)` (blocking on the result), after two
    warm-up calls. CPU time is this process's (all its threads): on CPUs shared with other work it moves far
    less with their load than wall time does, so the table's shares are computed from it."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    walls, cpus = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(*args))
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return min(walls) * 1e3, sorted(cpus)[len(cpus) // 2] * 1e3


def decode_inputs(config, batch: int, context: int, page_size: int, seed: int = 0):
    """KV pages (random, per layer) and decode metadata: `batch` sequences with `context` keys each."""
    rng = np.random.default_rng(seed)
    blocks = -(-(context + 1) // page_size)
    num_pages = batch * blocks + 1
    order = rng.permutation(np.arange(1, num_pages, dtype=np.int32))  # pages scattered, as after churn
    tables = order.reshape(batch, blocks)
    pos = np.full(batch, context, np.int32)
    slots = tables[np.arange(batch), pos // page_size] * page_size + pos % page_size
    meta = PagedMeta(
        jnp.asarray(slots),
        jnp.asarray(pos + 1),
        jnp.asarray(tables),
        jnp.arange(batch + 1, dtype=jnp.int32),
        jnp.asarray([batch], jnp.int32),
    )
    shape = kv_pages_shape(num_pages, config.num_kv_heads, page_size, config.head_dim)
    dtype = jnp.dtype(config.dtype)
    kv = tuple(jnp.asarray(rng.standard_normal(shape, np.float32) * 0.5, dtype) for _ in range(config.num_layers))
    tokens = jnp.asarray(rng.integers(3, config.vocab_size, batch), jnp.int32)
    return kv, meta, tokens, jnp.asarray(pos)


def sampling_meta(batch: int, mode: str) -> SamplingMeta:
    m = empty_meta(batch)
    if mode != "greedy":
        m["temperature"][:] = 0.8
        m["seed"][:, 0] = np.arange(batch)
    if mode == "filter":
        m["top_k"][:], m["top_p"][:] = 50, 0.9
    return SamplingMeta(**{k: jnp.asarray(v) for k, v in m.items()})


def profile(model: str, dtype: str, batch: int, context: int, reps: int) -> list[tuple[str, tuple[float, float]]]:
    config, params, _ = load_model(model, dtype=dtype)
    c = config
    p = params["params"]
    lp = [p[f"layers_{i}"] for i in range(c.num_layers)]
    kv, meta, tokens, positions = decode_inputs(c, batch, context, page_size=16)
    act = jnp.dtype(c.dtype)
    x = jax.random.normal(jax.random.key(1), (batch, c.hidden_size), jnp.float32).astype(act)
    cos, sin = layers.rope_cos_sin(positions, layers.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling))
    rows = []

    # The runner's options for a step of `batch` tokens (runner.forward_job).
    onednn = xla_flags.use_onednn_dots(c.dtype, "cpu") and batch >= xla_flags.ONEDNN_MIN_TOKENS
    options = dict(xla_flags.forward_compiler_options(onednn))

    def compiled(fn, *args):
        """`fn` (jitted) compiled for `args` with the step's options."""
        return fn.lower(*args).compile(compiler_options=options)

    # The whole step: the runner's forward (all layers + LM head on 32 rows) and each sampler variant.
    model, forward = step_functions(StepKey(c, "auto", onednn=onednn))
    sample_rows = jnp.arange(batch, dtype=jnp.int32)
    forward = compiled(forward, params, kv, tokens, positions, meta, sample_rows)
    state = {"kv": kv}

    def step():
        logits, state["kv"], _ = forward(params, state["kv"], tokens, positions, meta, sample_rows)
        return logits

    rows.append(("forward step (all layers + logits)", timeit(step, reps=reps)))
    logits = step()
    for mode in ("greedy", "sample", "filter"):
        flags = dict(do_sample=mode != "greedy", do_filter=mode == "filter", do_penalty=False, want_logprobs=False)
        fn = jax.jit(lambda lg, m, f=flags: sample(lg, m, **f))
        rows.append((f"sampler {mode}", timeit(fn, logits, sampling_meta(batch, mode), reps=reps)))
    kv = state["kv"]

    # The parts, each over all layers in one jitted call.
    def over_layers(f: Callable) -> Callable:
        return jax.jit(lambda *a: [f(i, *a) for i in range(c.num_layers)])

    def norm(w, h):
        return layers.RMSNorm(c.hidden_size, c.rms_norm_eps, act).apply({"params": w}, h)

    parts = {
        "embed": (jax.jit(lambda t: p["embed_tokens"]["embedding"][t]), (tokens,)),
        "RMSNorm x2": (
            over_layers(lambda i, h: (norm(lp[i]["input_layernorm"], h), norm(lp[i]["post_attention_layernorm"], h))),
            (x,),
        ),
        "QKV projection": (over_layers(lambda i, h: layers.qkv_projection(h, lp[i]["self_attn"], c)), (x,)),
    }
    q, k, v = layers.qkv_projection(x, lp[0]["self_attn"], c)
    parts |= {
        "RoPE (q, k)": (
            over_layers(lambda i, a, b: (layers.apply_rope(a, cos, sin), layers.apply_rope(b, cos, sin))),
            (q, k),
        ),
        "attention (paged, auto backend)": (
            over_layers(
                lambda i, a, kvs: pallas_kernels.ragged_paged_attention(
                    a,
                    kvs[i],
                    meta.kv_lens,
                    meta.block_tables,
                    meta.cu_q_lens,
                    meta.num_seqs,
                    sm_scale=c.head_dim**-0.5,
                    backend="auto",
                )
            ),
            (q, kv),
        ),
        "o projection": (over_layers(lambda i, a: layers.out_projection(a, lp[i]["self_attn"])), (q,)),
        "MLP (gate/up, SiLU, down)": (over_layers(lambda i, h: layers.gated_mlp(h, lp[i]["mlp"])), (x,)),
        "final norm + LM head (32 rows)": (
            jax.jit(lambda h: model.apply(params, norm(p["norm"], h), round_to_dtype=onednn, method="compute_logits")),
            (x,),
        ),
    }
    for name, (fn, args) in parts.items():
        rows.append((name, timeit(compiled(fn, *args), *args, reps=reps)))
    write = jax.jit(
        lambda kvs, a, b: [pallas_kernels.write_kv(t, a, b, meta.slot_mapping) for t in kvs], donate_argnums=(0,)
    )
    holder = {"kv": kv}

    def write_all() -> list[jax.Array]:
        holder["kv"] = write(holder["kv"], k, v)
        return holder["kv"]

    rows.append(("KV write (in place)", timeit(write_all, reps=reps)))
    rows.append(("dispatch floor (x + 1)", timeit(jax.jit(lambda h: h + 1), x, reps=reps)))
    return rows


def engine_step_ms(model: str, dtype: str, batch: int, new: int = 96) -> dict[str, float]:
    """A real engine run (`batch` prompts of 128 tokens, `new` greedy tokens, lookahead on): the fastest and the
    median wall time of its last 48 steps (all decode steps of the whole batch), the median main-thread CPU ms and
    the median wall ms blocked collecting samples of those steps."""
    from paged_jax.config.engine import EngineConfig
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.sampling_params import SamplingParams

    config, params, tok = load_model(model, dtype=dtype)
    ec = EngineConfig(
        max_model_len=512,
        max_num_seqs=batch,
        max_num_batched_tokens=1024,
        num_pages=batch * 20 + 1,
        attention_backend="auto",
        enable_prefix_caching=False,
        warmup=False,
    )  # compile only the shapes this run reaches
    engine = LLMEngine(config, params, tok, ec)
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", rng.integers(3, config.vocab_size, 128).tolist(), sp)
    times, cpu, waits = [], [], []
    while engine.has_unfinished():
        t0, c0, w0 = time.perf_counter(), time.thread_time(), engine.runner.device_seconds
        engine.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        waits.append(engine.runner.device_seconds - w0)
    return {
        "min": min(times[-48:]) * 1e3,
        "median": float(np.median(times[-48:])) * 1e3,
        "cpu": float(np.median(cpu[-48:])) * 1e3,
        "wait": float(np.median(waits[-48:])) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/paged_jax_peers/model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--engine", action="store_true", help="also time decode steps of a real engine run")
    args = ap.parse_args()
    xla_flags.log_settings()
    engine = engine_step_ms(args.model, args.dtype, args.batch) if args.engine else None
    rows = profile(args.model, args.dtype, args.batch, args.context, args.reps)
    step = rows[0][1][1]
    onednn = xla_flags.use_onednn_dots(args.dtype, "cpu") and args.batch >= xla_flags.ONEDNN_MIN_TOKENS
    print(
        f"\ndecode step profile: {args.model} {args.dtype}, batch {args.batch}, context {args.context}, "
        f"{args.reps} calls each; load average {os.getloadavg()[0]:.1f}; weight dots: "
        f"{'oneDNN (AMX)' if onednn else 'XLA default'}"
    )
    print(f"{'part':44s} {'wall ms':>8s} {'CPU ms':>8s} {'CPU % of forward':>17s}")
    for name, (wall, cpu) in rows:
        print(f"{name:44s} {wall:8.2f} {cpu:8.2f} {cpu / step:16.0%}")
    if engine:
        print(f"{'engine decode step, fastest / median (wall)':44s} {engine['min']:8.2f} {engine['median']:8.2f}")
        # Not the engine's host_seconds: that is wall time outside the samples' wait, blocking inside a launch
        # included (24 ms per step beside 2.6 ms of main-thread CPU on the 56M float32 run).
        print(f"{'  main-thread CPU per step (host work)':44s} {engine['cpu']:8.2f}")
        print(f"{'  blocked collecting the samples (wall)':44s} {engine['wait']:8.2f}")
        print(f"{'  forward + greedy sampler alone (wall)':44s} {rows[0][1][0] + rows[1][1][0]:8.2f}")


if __name__ == "__main__":
    main()
