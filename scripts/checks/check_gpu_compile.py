"""Ahead-of-time compile of the GPU kernel and the engine step for an H200 (sm_90a), on a machine without a GPU.

The twin of ``check_tpu_compile.py``; runs from ``.venv-gpu`` (``make gpu-check``: jax's CUDA plugin, its PJRT
and the ``nvidia-cuda-nvcc`` wheel's ptxas; no GPU, no system CUDA). Compiles through XLA, Triton, LLVM NVPTX
and ``ptxas -arch=sm_90a`` to SASS (:mod:`pallas_kernels.analysis.gpu_aot`) and exits non-zero on any failure.

**Kernel cases** (:data:`KERNEL_CASES`; the base decode, prefill and int8 kernels compile in the engine steps below):
every value of every axis once (bucket kind: decode, split-KV decode, prefill, mixed; head_dim 64/128/256; page size
16/32/64/128; KV dtype bf16/int8/fp8_e4m3/f32, and float32 queries over int8; query group 1/3/4/7/8; sliding window;
soft cap), plus the pairs that interact (dtype x page size, dtype x prefill, head_dim x prefill, group x prefill,
window x prefill), not the full product. Per kernel it prints registers, spill bytes, shared memory, threads, grid,
whether the loop's loads are asynchronous copies (``cp.async``/TMA), which MMA it issues (wgmma or mma.sync), and
whether some KV loop feeds the MMA with no select in between. It fails on a spill (spills are fatal to the compile),
on shared memory over the H200's 227 KiB per block (XLA refuses it), when the attention kernel of a decode or prefill
case loses its asynchronous page gather or its unmasked KV loop, and when a prefill kernel of head_dim >= 128 does not
issue wgmma.

**Gated delta rule** (``gated_delta_gpu.py``): the Triton kernel of Qwen3.5's linear attention at Qwen3.5-9B's
shapes (prefill 4 x 512, chunked prefill with decodes, decode 64 and 256, float32 inputs); fails on a spill or a
copy of the state pool.

**Engine steps** (:data:`STEP_CASES`): the engine's own jitted forward step (the runner an ``LLMEngine``
builds, abstract: :mod:`paged_jax.engine.aot`) for a few representative engines: Llama-3.1-8B at TP 1 and 8
(``1x1x8``) with a decode and a prefill bucket; int8 pages with LoRA (4 slots); Gemma-3-4B's decode and prefill
(its layer groups: five sliding-window layers and one global per scan step, then a remainder; its 7 KV cache
groups, at the engine's page count and at a small cache of 257 pages); an n-gram speculating
engine's verify step (and its sampler) on Llama-3.2-1B; every one scanned, as ``scan_layers="auto"`` runs it.
Sized for the H200 as the engine sizes itself; fails on a KV page copy, on a layer weight copied in the step
(``w-copy``, GiB per step: ``paged_jax.worker.hlo_audit.weight_copies``; a scanned step's cuBLAS dots read the
stacked weights in place, ``paged_jax.worker.xla_flags`` and ``paged_jax.model.decoder.CausalLM._scan``), on a
peak over the device's memory, on temporaries growing with the cache, and when its attention kernels fail the
kernel cases' tests (:func:`check_steps`).

**Qwen3.5** (``--hybrid LAYERS``, off by default: minutes on two cores; ``--only-hybrid`` skips the rest): the
engine steps of ``configs/qwen3.5-9b.json`` with its first LAYERS layers, judged as the steps above, with the
state pool's arrays among those that must not be copied and the gated delta kernel required in the step.

    .venv-gpu/bin/python scripts/checks/check_gpu_compile.py [--cases NAME ...] [--no-steps] [--hybrid 4]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax: the CUDA plugin must not look for a GPU

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # its sibling modules, also when loaded by path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gated_delta_gpu  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import kv_quant  # noqa: E402
from pallas_kernels.analysis.gpu_aot import HEADER, H200Compiler, KernelReport  # noqa: E402
from pallas_kernels.common import kv_pages_shape  # noqa: E402
from pallas_kernels.gpu.ragged_paged_attention import ragged_paged_attention_gpu  # noqa: E402


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One call of the GPU kernel: a bucket (tokens x sequence slots, table width) and the model's shapes."""

    name: str
    num_tokens: int = 64
    max_seqs: int = 64
    max_blocks: int = 512  # 8k context at page 16
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    kv_dtype: str = "bfloat16"
    q_dtype: str = "bfloat16"
    sliding_window: int | None = None
    soft_cap: float | None = None

    def args(self, sharding) -> tuple:
        sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
        num_pages = self.max_seqs * self.max_blocks + 1
        shape = kv_pages_shape(num_pages, self.num_kv_heads, self.page_size, self.head_dim)
        kv = sds(shape, jnp.dtype(self.kv_dtype))
        if kv_quant.is_quantized_dtype(kv.dtype):
            scales = sds(kv_quant.scales_shape(num_pages, self.num_kv_heads, self.page_size), jnp.float32)
            kv = kv_quant.QuantizedPages(kv, scales)
        return (
            sds((self.num_tokens, self.num_q_heads, self.head_dim), jnp.dtype(self.q_dtype)),
            kv,
            sds((self.max_seqs,), jnp.int32),
            sds((self.max_seqs, self.max_blocks), jnp.int32),
            sds((self.max_seqs + 1,), jnp.int32),
            sds((1,), jnp.int32),
        )

    def fn(self):
        return lambda *a: ragged_paged_attention_gpu(
            *a, sm_scale=self.head_dim**-0.5, soft_cap=self.soft_cap, sliding_window=self.sliding_window
        )


_SPLIT = dict(num_tokens=16, max_seqs=8, max_blocks=2048)  # a small batch at 32k: split-KV + combine
_PREFILL = dict(num_tokens=512, max_seqs=16)  # a chunked-prefill bucket: prefill + decode ranges
_MIXED = dict(num_tokens=256, max_seqs=64)  # decodes beside chunks
KERNEL_CASES = (
    # Each axis, every value, varied from a Llama-3-8B decode bucket; that base's decode, prefill and int8 kernels
    # compile (and are judged the same way) inside the engine steps of STEP_CASES.
    KernelCase("split-kv", **_SPLIT),
    KernelCase("mixed", **_MIXED),
    KernelCase("hd64", num_q_heads=32, num_kv_heads=8, head_dim=64),
    KernelCase("hd256", num_q_heads=16, num_kv_heads=8, head_dim=256),
    KernelCase("page32", page_size=32, max_blocks=256),
    KernelCase("page64", page_size=64, max_blocks=128),
    KernelCase("page128", page_size=128, max_blocks=64),
    KernelCase("fp8", kv_dtype="float8_e4m3fn"),
    KernelCase("group1", num_q_heads=8),
    KernelCase("group3", num_q_heads=9, num_kv_heads=3, head_dim=64),  # SmolLM2-135M
    KernelCase("group7", num_q_heads=14, num_kv_heads=2, head_dim=64),  # Qwen2.5-0.5B
    KernelCase("group8", num_q_heads=64),
    KernelCase("window", sliding_window=4096),
    KernelCase("softcap", soft_cap=50.0),
    # Pairs that interact: tile sizes and shared memory move with dtype x page, and with the prefill tiling.
    KernelCase("int8-page64", kv_dtype="int8", page_size=64, max_blocks=128),
    KernelCase("fp8-page128", kv_dtype="float8_e4m3fn", page_size=128, max_blocks=64),
    KernelCase("int8-prefill", kv_dtype="int8", **_PREFILL),
    KernelCase("hd256-prefill", num_q_heads=16, num_kv_heads=8, head_dim=256, **_PREFILL),
    KernelCase("hd64-prefill", head_dim=64, **_PREFILL),
    KernelCase("group8-prefill", num_q_heads=64, **_PREFILL),
    KernelCase("window-softcap-prefill", sliding_window=4096, soft_cap=50.0, **_PREFILL),
    KernelCase("f32", q_dtype="float32", kv_dtype="float32"),
    KernelCase("f32-prefill", q_dtype="float32", kv_dtype="float32", **_PREFILL),
    KernelCase("f32-split", q_dtype="float32", kv_dtype="float32", **_SPLIT),
    KernelCase("f32q-int8", q_dtype="float32", kv_dtype="int8"),
    KernelCase("f32q-int8-prefill", q_dtype="float32", kv_dtype="int8", **_PREFILL),
    KernelCase("hd256-fp8-split", num_q_heads=16, head_dim=256, kv_dtype="float8_e4m3fn", **_SPLIT),
)


def kernel_failures(head_dim: int, reports: list[KernelReport]) -> list[str]:
    """What the compiled text of a kernel case or an engine step of `head_dim` must show (module docstring);
    spills and shared memory already fail the compile."""
    bad = []
    attention = [r for r in reports if r.name.startswith("ragged_paged_attention_gpu") and "combine" not in r.name]
    if not attention:
        return ["no attention kernel in the compiled step"]
    for r in attention:
        if r.spill_bytes:
            bad.append(f"{r.name}: {r.spill_bytes} bytes of register spills")
        if not r.async_copies:
            bad.append(f"{r.name}: the page gather is not pipelined (no cp.async / TMA)")
        if not r.clean_kv_loop:
            bad.append(f"{r.name}: no KV loop feeds the MMA without a select (V masked on every step)")
        if r.name.endswith("_prefill") and head_dim >= 128 and r.mma != "wgmma":
            bad.append(f"{r.name}: prefill issues {r.mma}, not wgmma")
    return bad


def check_kernels(compiler: H200Compiler, cases=KERNEL_CASES) -> int:
    """Compile every kernel case; prints one row per kernel; returns the failure count."""
    mesh = jax.sharding.Mesh(np.array(compiler.devices[:1]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    failures = 0
    print("\nGPU kernel cases compiled for H200 (sm_90a); spills are fatal")
    print(f"{'case':<24}{HEADER}")
    for case in cases:
        t0 = time.perf_counter()
        try:
            _, reports = compiler.compile(case.fn(), *case.args(sharding), mesh=mesh)
        except Exception:  # noqa: BLE001 - every compiler error is a failure to report
            failures += 1
            print(f"FAIL {case.name} ({time.perf_counter() - t0:.0f}s)\n{traceback.format_exc(limit=3)}")
            continue
        for r in sorted(reports, key=lambda r: r.name):
            if r.name.startswith("ragged_paged_attention_gpu"):
                print(f"{case.name:<24}{r.row()}")
        bad = kernel_failures(case.head_dim, reports)
        for line in bad:
            print(f"FAIL {case.name}: {line}")
        failures += bool(bad)
        print(f"{'':<24}({time.perf_counter() - t0:.1f}s)")
    return failures


@dataclasses.dataclass(frozen=True)
class StepCase:
    """An engine (a shipped config and `EngineConfig` options) and the kinds of its step to compile."""

    config: str
    tp: int = 1
    kinds: tuple[str, ...] = ("decode", "prefill")
    options: tuple[tuple[str, object], ...] = ()  # EngineConfig fields beyond TP and the backend
    label: str = ""  # what the options make of the engine
    layers: int = 0  # compile only the config's first `layers` layers (0: all)

    @property
    def name(self) -> str:
        return f"{self.config} TP{self.tp}" + (f" {self.label}" if self.label else "")


_NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
_INT8_LORA = (("kv_dtype", "int8"), ("enable_lora", True), ("max_loras", 4))
STEP_CASES = (  # a few representative engines: the TP layouts, quantized pages, LoRA and speculation
    StepCase("llama-3.1-8b"),  # GQA 4, head_dim 128: the base decode and prefill kernels
    StepCase("llama-3.1-8b", 8, kinds=("decode",)),  # one KV head per GPU: split-KV decode with its combine
    StepCase("llama-3.1-8b", kinds=("decode",), options=_INT8_LORA, label="int8 KV, lora x4"),
    # layer groups (windows 5:1, a remainder), head_dim 256; hybrid KV: 7 KV cache groups, pages of 5 layer slabs, at
    # the engine's page count and at 257 pages (16 MiB per slab array)
    StepCase("gemma-3-4b"),
    StepCase("gemma-3-4b", options=(("num_pages", 257),), label="hybrid KV 257p"),
    StepCase("llama-3.2-1b", kinds=("verify",), options=(("speculative_config", _NGRAM),), label="ngram k=3"),
)
H200_BYTES_LIMIT = int(0.75 * 150_754_820_096)  # what jax reports on an H200: XLA preallocates 75% by default
MAX_TEMP_FRACTION = 0.05  # temporaries that grow with the KV cache, of one layer's KV pages


def check_steps(compiler: H200Compiler, cases=STEP_CASES) -> int:
    """The engine's own jitted forward steps (`paged_jax.engine.aot`: the runner an `LLMEngine` builds, abstract,
    sized for the H200 as the engine would size it) compiled for H200s, spills fatal; a verify step's sampler
    too. Fails on a KV page array or a layer weight copied in the step (`paged_jax.worker.hlo_audit`), on a
    step whose peak memory exceeds the device's, and on temporaries that grow with the KV cache beyond 5% of one
    layer's pages (measured again at 64 pages when over). Prints per step its kernels' largest registers and
    shared memory."""
    from paged_jax.config import load_model_config
    from paged_jax.config.engine import EngineConfig
    from paged_jax.engine.aot import (
        abstract_engine,
        audit_step,
        layer_weight_shapes,
        step_job,
        step_shape,
        verify_sample_job,
    )
    from paged_jax.worker.hlo_audit import weight_copies

    failures = 0
    gib, mib = 2**-30, 2**-20
    print(f"\nengine steps for H200 (bytes_limit {H200_BYTES_LIMIT * gib:.1f} GiB per GPU; temp/peak per GPU)")
    print(
        f"{'engine':<44}{'step':>8}{'tokens':>7}{'seqs':>5}{'KV shape/GPU':>22}{'KV tokens':>11}{'copies':>7}"
        f"{'temp MiB':>9}{'peak GiB':>9}{'w-copy':>7}{'regs':>5}{'smem KiB':>9}{'time':>6}"
    )
    for case in cases:
        config = load_model_config(case.config)
        config = config.replace(num_layers=case.layers) if case.layers else config
        ec = EngineConfig(attention_backend="pallas-gpu", tensor_parallel_size=case.tp, **dict(case.options))
        for kind in case.kinds:
            name = f"{case.name} {kind}"
            t0 = time.perf_counter()
            try:
                engine = abstract_engine(config, ec, compiler.devices[: case.tp], H200_BYTES_LIMIT)
                runner = engine.runner
                compiled, reports = _compile_job(compiler, engine, step_job(runner, kind))
                audit = audit_step(compiled, engine)
                growth = 0
                if audit.temp_bytes > MAX_TEMP_FRACTION * engine.layer_kv_bytes:
                    small_ec = dataclasses.replace(ec, num_pages=64)
                    small = abstract_engine(config, small_ec, compiler.devices[: case.tp], H200_BYTES_LIMIT)
                    small_step, _ = _compile_job(compiler, small, step_job(small.runner, kind))
                    growth = audit.temp_bytes - audit_step(small_step, small).temp_bytes
                if kind == "verify":
                    _compile_job(compiler, engine, verify_sample_job(runner))
            except Exception:  # noqa: BLE001 - every compiler error is a failure to report
                failures += 1
                print(f"FAIL {name} ({time.perf_counter() - t0:.0f}s)\n{traceback.format_exc(limit=4)}")
                continue
            weights = weight_copies(compiled.as_text(), layer_weight_shapes(engine), config.num_layers)
            t, s = step_shape(runner, kind)
            shape = "x".join(map(str, engine.local_kv_shape))
            print(
                f"{case.name:<44}{kind:>8}{t:>7}{s:>5}{shape:>22}{engine.kv_tokens:>11,}{len(audit.copies):>7}"
                f"{audit.temp_bytes * mib:>9.1f}{audit.peak_bytes * gib:>9.2f}{weights.hbm_bytes * gib:>7.2f}"
                f"{max(r.registers for r in reports):>5}{max(r.shared_memory for r in reports) / 1024:>9.1f}"
                f"{time.perf_counter() - t0:>5.0f}s"
            )
            bad = [f"KV copy: {line}" for line in audit.copies[:4]]
            if weights.hbm_bytes:
                bad.append(f"w-copy: {weights.hbm_bytes * gib:.2f} GiB of layer weights copied: {weights.lines[0]}")
            if not audit.fits(H200_BYTES_LIMIT):
                bad.append(f"peak {audit.peak_bytes * gib:.2f} GiB exceeds {H200_BYTES_LIMIT * gib:.2f} GiB")
            if growth > MAX_TEMP_FRACTION * engine.layer_kv_bytes:
                bad.append(f"temporaries grow by {growth * mib:.1f} MiB with the KV cache")
            bad += kernel_failures(config.head_dim, reports)
            if config.full_attention_interval and not any(r.name.startswith("gated_delta_gpu") for r in reports):
                bad.append("a linear-attention step without the gated delta kernel (gated_delta_gpu)")
            for line in bad:
                print(f"FAIL {name}: {line}")
            failures += bool(bad)
    return failures


def _compile_job(compiler: H200Compiler, engine, job):
    """One of an abstract engine's jobs compiled for the H200: (compiled, kernel reports)."""
    return compiler.compile(None, mesh=engine.mesh, lower=functools.partial(engine.lower, job), options=job.options)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [c.name for c in KERNEL_CASES]
    parser.add_argument("--cases", nargs="*", default=names, choices=names, metavar="CASE")
    parser.add_argument("--no-steps", dest="steps", action="store_false", help="skip the engine steps")
    parser.add_argument(
        "--hybrid",
        type=int,
        default=0,
        metavar="LAYERS",
        help="also compile Qwen3.5-9B's decode and prefill steps (configs/qwen3.5-9b.json) with its first LAYERS"
        " layers (4: one group of 3 Gated DeltaNet layers and 1 full-attention layer; 32: the whole model; 0: skip,"
        " the default: minutes on two cores)",
    )
    parser.add_argument("--only-hybrid", action="store_true", help="with --hybrid: skip every other case")
    args = parser.parse_args()
    t0 = time.perf_counter()
    compiler = H200Compiler(max(c.tp for c in STEP_CASES))
    try:
        failures = 0
        if not args.only_hybrid:
            failures += check_kernels(compiler, [c for c in KERNEL_CASES if c.name in args.cases])
            failures += gated_delta_gpu.check(compiler)
            if args.steps:
                failures += check_steps(compiler)
        if args.hybrid:
            hybrid = StepCase("qwen3.5-9b", layers=args.hybrid, label=f"{args.hybrid} layers")
            failures += check_steps(compiler, [hybrid])
    finally:
        compiler.close()
    print(f"{failures} failure(s) ({time.perf_counter() - t0:.0f}s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
