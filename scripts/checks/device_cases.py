"""How each kind of device-check case runs: environment, copy bandwidth, page-id probe, random inputs against
the dense reference, timings and the block-config sweep (which cases, in which group: :mod:`device_groups`).

A :class:`Group` runs in one child process with its own timeout (a crash or an illegal address ends that group
only). Nothing here touches a device until a case runs. Every case returns its result fields; a case that
judges sets ``passed``. Case names are ``group/what[-size]-dtype-backend``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from collections.abc import Callable

import device_probe
import device_timing
import jax
import jax.numpy as jnp
import numpy as np
from device_probe import ProbeShape

import pallas_kernels
from pallas_kernels import kv_quant


@dataclasses.dataclass(frozen=True)
class Context:
    """What a running case may use: where files go, the platform, and whether the probe tables are corrupted."""

    out: pathlib.Path
    platform: str  # "gpu" or "cpu"
    corrupt_table: bool


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Context], dict]
    plan: dict  # what it will do (shapes, backend), listed by --dry-run


@dataclasses.dataclass(frozen=True)
class Group:
    name: str
    part: int
    timeout_s: float
    cases: tuple[Case, ...]


# -- environment and copy bandwidth -----------------------------------------------------------------------------


def env_run(ctx: Context) -> dict:
    """Devices, memory, ``jax.print_environment_info()`` and (GPU) the compiler's target config, into env/."""
    env = ctx.out / "env"
    env.mkdir(parents=True, exist_ok=True)
    info = jax.print_environment_info(return_string=True)
    (env / "jax_environment.txt").write_text(info or "")
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    row = {"backend": jax.default_backend(), "device": dev.device_kind, "devices": jax.device_count()}
    row["bytes_limit"] = stats.get("bytes_limit")
    if jax.default_backend() == "gpu":
        try:
            from jax._src.lib import _jax

            text = str(_jax.get_topology_for_devices(jax.devices()).target_config)
            (env / "target_config.txtpb").write_text(text)
            row["target_config"] = "env/target_config.txtpb"
        except Exception as e:  # noqa: BLE001 - optional detail
            row["target_config"] = f"unavailable: {type(e).__name__}"
    return row


def bandwidth_run(elements: int) -> Callable[[Context], dict]:
    def run(ctx: Context) -> dict:
        """A copy XLA cannot fold (``x * 1.0001``, read + write counted), kept in bandwidth.json for the timings."""
        x = jnp.ones((elements,), jnp.float32)
        scale = jax.jit(lambda a: a * jnp.float32(1.0001))
        t = device_timing.time_call(scale, x, iters=20)
        bw = 2 * x.nbytes / (t.best_us * 1e-6)
        (ctx.out / "bandwidth.json").write_text(json.dumps({"bytes_per_s": bw}))
        return {**t.fields(), "bytes": 2 * x.nbytes, "copy_GBps": bw / 1e9, "pct_of_4.8TBps": 100 * bw / 4.8e12}

    return run


def _measured_bandwidth(ctx: Context) -> float | None:
    path = ctx.out / "bandwidth.json"
    return json.loads(path.read_text())["bytes_per_s"] if path.exists() else None


# -- exactness ----------------------------------------------------------------------------------------------------


def probe_case(shape: ProbeShape, backend: str) -> Case:
    name = f"{shape_name(shape)}-{backend}"
    run = lambda ctx: device_probe.run_probe(shape, backend, corrupt=ctx.corrupt_table)
    return Case(name, run, {**shape.describe(), "backend": backend})


def shape_name(shape: ProbeShape) -> str:
    d, kv, q = shape.head_dim, shape.kv_dtype.replace("float8_e4m3fn", "fp8"), shape.q_dtype
    return f"d{d}-{kv}" + ("" if q == "bfloat16" or q == shape.kv_dtype else f"-q{q}")


@dataclasses.dataclass(frozen=True)
class RandomSpec:
    """A random ragged batch (:func:`pallas_kernels.testing.make_case`: NaN-poisoned, random page order)."""

    seed: int
    q_dtype: str
    kv_dtype: str | None  # None: pages in q_dtype; int8 / float8_e4m3fn: quantized
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_tokens: int
    max_seqs: int
    max_kv: int
    sliding_window: int | None = None
    soft_cap: float | None = None
    decode_seqs: tuple[int, int] | None = None  # (batch, context): every sequence one query at this context


def random_tolerance(q_dtype: str) -> float:
    """Max error relative to rms(reference): bfloat16 rounds the probabilities and the output (2^-9 relative
    each); float32 kernels differ from the HIGHEST-precision reference by summation order only."""
    return 3e-2 if jnp.dtype(q_dtype) == jnp.bfloat16 else 1e-4


def _random(spec: RandomSpec, backend: str) -> Callable[[Context], dict]:
    def run(ctx: Context) -> dict:
        from pallas_kernels.testing import make_case, random_seqs

        rng = np.random.default_rng(spec.seed)
        if spec.decode_seqs:
            seqs = [(1, spec.decode_seqs[1])] * spec.decode_seqs[0]
        else:
            seqs = random_seqs(rng, spec.num_tokens, spec.max_seqs, spec.max_kv)
        case = make_case(
            spec.seed,
            seqs,
            num_tokens=spec.num_tokens,
            max_seqs=spec.max_seqs,
            num_q_heads=spec.num_q_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            page_size=spec.page_size,
            dtype=jnp.dtype(spec.q_dtype),
            kv_dtype=None if spec.kv_dtype is None else jnp.dtype(spec.kv_dtype),
        )
        opts = dict(sm_scale=spec.head_dim**-0.5, sliding_window=spec.sliding_window, soft_cap=spec.soft_cap)
        out = pallas_kernels.ragged_paged_attention(*case.paged_args, backend=backend, **opts)
        ref = pallas_kernels.dense_reference_attention(*case.dense_args, **opts)
        return judge_random(out, ref, int(case.cu_q_lens[len(seqs)]), spec.q_dtype) | {"seqs": len(seqs)}

    return run


def judge_random(out, ref, real_tokens: int, q_dtype: str) -> dict:
    """Max error over real rows relative to rms(ref); padding rows must be zeros, the output finite."""
    out, ref = (np.asarray(jax.device_get(x), np.float32) for x in (out, ref))
    rms = float(np.sqrt(np.mean(np.square(ref[:real_tokens], dtype=np.float64))))
    finite, padding_zero = bool(np.all(np.isfinite(out))), bool(not np.any(out[real_tokens:]))
    err = float(np.max(np.abs(out[:real_tokens] - ref[:real_tokens]))) / rms if finite else float("inf")
    tol = random_tolerance(q_dtype)
    passed = finite and padding_zero and err <= tol
    return {"passed": passed, "err_rel_rms": err, "tol_rel_rms": tol, "finite": finite, "padding_zero": padding_zero}


def random_case(spec: RandomSpec, backend: str) -> Case:
    kv = (spec.kv_dtype or spec.q_dtype).replace("float8_e4m3fn", "fp8")
    size = f"b{spec.decode_seqs[0]}x{spec.decode_seqs[1]}" if spec.decode_seqs else f"mixed{spec.num_tokens}"
    name = f"{size}-d{spec.head_dim}-{kv}" + (f"-q{spec.q_dtype}" if spec.kv_dtype else "") + f"-s{spec.seed}"
    return Case(f"exact/{name}-{backend}", _random(spec, backend), {**dataclasses.asdict(spec), "backend": backend})


# -- timings --------------------------------------------------------------------------------------------------------


def _timed(shape: ProbeShape, backend: str, iters: int) -> Callable[[Context], dict]:
    def run(ctx: Context) -> dict:
        """Kernel-only and host-to-host time of one call on the probe's inputs (also judged), its GB/s of the KV
        it must read, % of the measured copy bandwidth and of 4.8 TB/s, and useful TFLOP/s."""
        inputs = device_probe.build(shape)
        fn = functools.partial(pallas_kernels.ragged_paged_attention, sm_scale=shape.head_dim**-0.5, backend=backend)
        args = (inputs.q, inputs.kv, inputs.kv_lens, inputs.block_tables, inputs.cu_q_lens, inputs.num_seqs)
        t = device_timing.time_call(fn, *args, inputs.page_offset, iters=iters, kernel_name="ragged_paged")
        per_key = kv_quant.bytes_per_token_head(shape.head_dim, jnp.dtype(shape.kv_dtype)) * shape.num_kv_heads
        kv_bytes = per_key * sum(kv for _, kv in shape.seqs)
        seen = sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in shape.seqs)  # visible (query, key) pairs
        flops = 4 * shape.num_q_heads * shape.head_dim * seen
        us = t.best_us
        row = {**t.fields(), "kv_bytes": kv_bytes, "GBps": kv_bytes / us / 1e3, "useful_TFLOPs": flops / us / 1e6}
        row["pct_of_4.8TBps"] = 100 * kv_bytes / (us * 1e-6) / device_timing.H200_HBM_BYTES_PER_S
        bw = _measured_bandwidth(ctx)
        if bw:
            row["pct_of_copy_bw"] = 100 * kv_bytes / (us * 1e-6) / bw
        if ctx.platform == "gpu":
            row.update(_work_model(shape, args))
        return row

    return run


def _work_model(shape: ProbeShape, args) -> dict:
    """The GPU work model's time for this plan and batch (what the measured kernel time is compared with)."""
    from pallas_kernels.gpu.plan import gpu_plan_for
    from pallas_kernels.gpu.work_model import gpu_work_detail
    from pallas_kernels.work_model import HARDWARE

    q, kv, lens, tables, cu, n = args
    values, _ = kv_quant.split(kv)
    plan = gpu_plan_for(q.shape, values.shape, tables.shape[0], tables.shape[1], values.dtype, q.dtype)
    work = gpu_work_detail(plan, np.asarray(lens), np.asarray(cu), int(np.asarray(n)[0]))["work"]
    return {"model_us": work.seconds(HARDWARE["h200"]) * 1e6}


def timing_case(name: str, shape: ProbeShape, backend: str, iters: int) -> Case:
    return Case(name, _timed(shape, backend, iters), {**shape.describe(), "backend": backend, "iters": iters})


# -- the block-config sweep ----------------------------------------------------------------------------------------

SWEEP_CONFIGS = [(keys, warps, stages) for keys in (32, 64, 128) for warps in (4, 8) for stages in (2, 3, 4)]


@functools.lru_cache(maxsize=1)
def _sweep_inputs(shape: ProbeShape) -> device_probe.ProbeInputs:
    return device_probe.build(shape)


def sweep_run(shape: ProbeShape, keys: int, warps: int, stages: int) -> Callable[[Context], dict]:
    def run(ctx: Context) -> dict:
        """One decode block config of the GPU kernel on the probe's inputs: kernel time, and the output judged."""
        from pallas_kernels.gpu.ragged_paged_attention import ragged_paged_attention_gpu

        inputs = _sweep_inputs(shape)
        tables = inputs.block_tables + inputs.page_offset
        opts = dict(pages_per_block=keys // shape.page_size, num_warps=warps, num_stages=stages)
        fn = jax.jit(functools.partial(ragged_paged_attention_gpu, sm_scale=shape.head_dim**-0.5, **opts))
        args = (inputs.q, inputs.kv, inputs.kv_lens, tables, inputs.cu_q_lens, inputs.num_seqs)
        t = device_timing.time_call(fn, *args, iters=30, kernel_name="ragged_paged")
        exp = device_probe.expected_for(shape, inputs, inputs.block_tables)
        wrong = device_probe.expected_for(shape, inputs, inputs.corrupted_tables)
        verdict = device_probe.judge(fn(*args), exp, wrong, inputs.real_tokens, shape.q_dtype)
        return {**verdict.fields(), **t.fields(), "kv_keys": keys, "num_warps": warps, "num_stages": stages}

    return run


def sweep_best(ctx: Context) -> dict:
    """The fastest passing config of the sweep so far, as a ready ``TUNED_BLOCK_CONFIGS`` entry (sweep_best.txt)."""
    import device_report

    from pallas_kernels.gpu.tuned_block_sizes import TUNED_BLOCK_CONFIGS

    rows = [r for r in device_report.latest_by_case(device_report.read_rows(ctx.out)).values()]
    ok = [r for r in rows if r["case"].startswith("sweep/decode-") and r.get("passed")]
    if not ok:
        return {"passed": False, "reason": "no config of the sweep ran and passed"}
    best = min(ok, key=lambda r: r["best_us"])
    prefill = TUNED_BLOCK_CONFIGS[(128, 16, "bfloat16")][1]
    entry = f'(128, 16, "bfloat16"): (BlockConfig(16, {best["kv_keys"]}, {best["num_warps"]}, {best["num_stages"]}), '
    entry += f"BlockConfig({prefill.rows}, {prefill.kv_keys}, {prefill.num_warps}, {prefill.num_stages})),"
    (ctx.out / "sweep_best.txt").write_text(entry + "\n")
    return {"entry": entry, "best_us": best["best_us"], "configs_passed": len(ok)}
