"""What the device check runs: its groups of cases, full size on a GPU and shrunk on the CPU backend.

A :class:`Group` runs in one child process with its own timeout (a crash or an illegal address ends that group
only); ``part`` 1 holds what decides whether the kernels are right (page-id probes, random inputs against the
dense reference, full-size stacked-cache addressing), part 2 the timings, the other head dims, the large
random cases and the block-config sweep. Nothing here touches a device until a case runs.

Every case returns its result fields; a case that judges sets ``passed``. Case names are
``group/what[-size]-dtype-backend``.
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


def _env(ctx: Context) -> dict:
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


def _bandwidth(elements: int) -> Callable[[Context], dict]:
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


def _probe(shape: ProbeShape, backend: str) -> Case:
    name = f"{_shape_name(shape)}-{backend}"
    run = lambda ctx: device_probe.run_probe(shape, backend, corrupt=ctx.corrupt_table)
    return Case(name, run, {**shape.describe(), "backend": backend})


def _shape_name(shape: ProbeShape) -> str:
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


def _random_case(spec: RandomSpec, backend: str) -> Case:
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


def _timing_case(name: str, shape: ProbeShape, backend: str, iters: int) -> Case:
    return Case(name, _timed(shape, backend, iters), {**shape.describe(), "backend": backend, "iters": iters})


# -- the block-config sweep ----------------------------------------------------------------------------------------

SWEEP_CONFIGS = [(keys, warps, stages) for keys in (32, 64, 128) for warps in (4, 8) for stages in (2, 3, 4)]


@functools.lru_cache(maxsize=1)
def _sweep_inputs(shape: ProbeShape) -> device_probe.ProbeInputs:
    return device_probe.build(shape)


def _sweep(shape: ProbeShape, keys: int, warps: int, stages: int) -> Callable[[Context], dict]:
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


def _sweep_best(ctx: Context) -> dict:
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


# -- the case lists ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Batch:
    """A named batch of sequences in its bucket (the engine's buckets: tokens >= 16, sequences >= 8)."""

    label: str
    seqs: tuple[tuple[int, int], ...]
    num_tokens: int
    max_seqs: int


def _mixed(rng_seed: int, chunks: int, chunk: int, chunk_kv: int, decodes: int, max_kv: int, tokens: int) -> Batch:
    rng = np.random.default_rng(rng_seed)
    seqs = [(chunk, chunk_kv)] * chunks + [(1, int(k)) for k in rng.integers(1, max_kv + 1, decodes)]
    return Batch(f"mixed{tokens}", tuple(seqs), tokens, max(8, 1 << (len(seqs) - 1).bit_length()))


GPU_BATCHES = {
    "decode": Batch("decode-b64x4k", ((1, 4096),) * 64, 64, 64),
    "deep": Batch("decode-b1x32k", ((1, 32768),), 16, 8),  # one sequence: the deepest split-KV
    "prefill": Batch("prefill-8x512@4k", ((512, 4096),) * 8, 4096, 8),
    "mixed": _mixed(0, 2, 512, 2048, 60, 4096, 2048),
}
CPU_BATCHES = {
    "decode": Batch("decode-b4x200", ((1, 200),) * 4, 8, 8),
    "deep": Batch("decode-b1x1000", ((1, 1000),), 16, 8),
    "prefill": Batch("prefill-2x32@96", ((32, 96),) * 2, 64, 8),
    "mixed": Batch("mixed48", ((24, 80), (1, 50), (1, 17), (8, 8)), 48, 8),
}
# (q heads, kv heads) per head_dim: Llama-3.1-8B (128), Llama-3.2-1B (64), a Gemma-like 256.
HEADS = {64: (32, 8), 128: (32, 8), 256: (16, 4)}
Q_DTYPE = {"bfloat16": "bfloat16", "float32": "float32", "int8": "bfloat16", "float8_e4m3fn": "bfloat16"}


def _shape(batch: Batch, head_dim: int, kv_dtype: str, q_dtype: str | None = None, heads=None, **cache) -> ProbeShape:
    qh, kvh = heads or HEADS[head_dim]
    return ProbeShape(
        seqs=batch.seqs,
        num_tokens=batch.num_tokens,
        max_seqs=batch.max_seqs,
        num_q_heads=qh,
        num_kv_heads=kvh,
        head_dim=head_dim,
        page_size=16,
        kv_dtype=kv_dtype,
        q_dtype=q_dtype or Q_DTYPE[kv_dtype],
        **cache,
    )


def _probe_named(group: str, batch: Batch, shape: ProbeShape, backend: str) -> Case:
    case = _probe(shape, backend)
    return dataclasses.replace(case, name=f"{group}/{batch.label}-{case.name}")


def _stacked(kv_dtype: str, layers: int, over_log2: int) -> dict:
    """A cache of ``layers`` layers (8 KV heads, 16-token pages, head_dim 128) just over 2^over_log2 elements."""
    per_page = 8 * 16 * 2 * 128
    return {"num_layers": layers, "pages_per_layer": 2**over_log2 // (layers * per_page) + 8}


RANDOM_SPECS = [  # the mixed random batches of the kernel tests, at the shapes where the kernels differ
    RandomSpec(0, "float32", None, 8, 2, 128, 16, 64, 8, 80),
    RandomSpec(1, "bfloat16", None, 32, 8, 128, 16, 64, 16, 200),
    RandomSpec(2, "bfloat16", None, 8, 1, 64, 8, 32, 8, 60),
    RandomSpec(3, "float32", None, 8, 8, 256, 32, 32, 8, 100, sliding_window=20),
    RandomSpec(4, "bfloat16", None, 16, 2, 64, 64, 64, 8, 150, soft_cap=30.0),
    RandomSpec(5, "bfloat16", None, 4, 4, 128, 128, 32, 8, 300, sliding_window=64, soft_cap=20.0),
    RandomSpec(6, "bfloat16", None, 14, 2, 64, 16, 16, 8, 3000),  # GQA 7, long: adaptive splits
    RandomSpec(7, "bfloat16", None, 32, 8, 128, 64, 8, 8, 5000, sliding_window=1000, soft_cap=30.0),
    RandomSpec(8, "bfloat16", "int8", 32, 8, 128, 16, 64, 16, 400),
    RandomSpec(9, "bfloat16", "float8_e4m3fn", 9, 3, 64, 16, 64, 8, 300),
    RandomSpec(10, "float32", "int8", 32, 8, 128, 16, 64, 16, 400),  # f32 queries over int8 pages
]
LARGE_RANDOM_SPECS = [
    RandomSpec(11, "bfloat16", None, 32, 8, 128, 16, 64, 64, 0, decode_seqs=(64, 4096)),
    RandomSpec(12, "float32", None, 32, 8, 128, 16, 64, 64, 0, decode_seqs=(64, 4096)),
    RandomSpec(13, "bfloat16", None, 32, 8, 128, 16, 16, 8, 0, decode_seqs=(1, 32768)),
]


def gpu_groups() -> list[Group]:
    """The H200 run: part 1 in about 8 minutes, part 2 after it."""
    b, pk = GPU_BATCHES, "pallas-gpu"
    groups = [Group("env", 1, 90, (Case("env/devices", _env, {}),))]
    groups.append(Group("bandwidth", 1, 60, (Case("bandwidth/copy-2GiB", _bandwidth(1 << 29), {"bytes": 2**32}),)))
    for kv in ("bfloat16", "int8", "float32", "float8_e4m3fn"):
        cases = [_probe_named("probe", b[k], _shape(b[k], 128, kv), pk) for k in ("decode", "deep", "prefill", "mixed")]
        cases += [_probe_named("probe", b[k], _shape(b[k], 128, kv), "xla") for k in ("decode", "mixed")]
        if kv == "int8":
            cases.append(_probe_named("probe", b["mixed"], _shape(b["mixed"], 128, kv, "float32"), pk))
        groups.append(Group(f"probe-{kv}", 1, 150, tuple(cases)))
    groups.insert(3, Group("exact", 1, 150, tuple(_random_case(s, pk) for s in RANDOM_SPECS)))
    groups.insert(6, Group("exact-xla", 1, 150, tuple(_random_case(s, "xla") for s in RANDOM_SPECS)))
    addr = (
        Batch("decode-b8x4k", ((1, 4096),) * 8, 8, 8),
        b["deep"],
        Batch("prefill-2x512@2k", ((512, 2048),) * 2, 1024, 8),
    )
    for kv in ("int8", "bfloat16", "float8_e4m3fn"):
        cases = []
        for layers, log2 in ((2, 31), (4, 32)):
            for batch in addr:
                shape = _shape(batch, 128, kv, **_stacked(kv, layers, log2))
                name = f"addressing/over-2^{log2}-{layers}layers-{batch.label}-{_shape_name(shape)}-{pk}"
                cases.append(dataclasses.replace(_probe(shape, pk), name=name))
        groups.insert(4 if kv == "int8" else len(groups), Group(f"addressing-{kv}", 1, 150, tuple(cases)))
    groups += _gpu_part2()
    return groups


def _gpu_part2() -> list[Group]:
    b, pk = GPU_BATCHES, "pallas-gpu"
    timing = [
        _timing_case(f"timing/{b['decode'].label}-d128-{kv}", _shape(b["decode"], 128, kv), pk, 50)
        for kv in ("bfloat16", "int8", "float8_e4m3fn", "float32")
    ]
    timing += [
        _timing_case(
            "timing/decode-b8x16k-d128-bfloat16",
            _shape(Batch("b8x16k", ((1, 16384),) * 8, 8, 8), 128, "bfloat16"),
            pk,
            50,
        ),
        _timing_case(f"timing/{b['deep'].label}-d128-bfloat16", _shape(b["deep"], 128, "bfloat16"), pk, 50),
        _timing_case(f"timing/{b['decode'].label}-d64-bfloat16", _shape(b["decode"], 64, "bfloat16"), pk, 50),
        _timing_case(f"timing/{b['prefill'].label}-d128-bfloat16", _shape(b["prefill"], 128, "bfloat16"), pk, 20),
        _timing_case(f"timing/{b['decode'].label}-d128-bfloat16-xla", _shape(b["decode"], 128, "bfloat16"), "xla", 20),
    ]
    groups = [Group("timing", 2, 240, tuple(timing))]
    groups.append(Group("exact-large", 2, 150, tuple(_random_case(s, pk) for s in LARGE_RANDOM_SPECS)))
    for d in (64, 256):
        cases = [
            _probe_named("probe", b[k], _shape(b[k], d, kv), pk)
            for kv in ("bfloat16", "float32", "int8")
            for k in ("decode", "prefill")
        ]
        groups.append(Group(f"probe-d{d}", 2, 180, tuple(cases)))
    shape = _shape(b["decode"], 128, "bfloat16")
    sweep = [
        Case(f"sweep/decode-k{k}-w{w}-s{st}", _sweep(shape, k, w, st), {"kv_keys": k, "num_warps": w, "num_stages": st})
        for k, w, st in SWEEP_CONFIGS
    ]
    sweep.append(Case("sweep/best", _sweep_best, {"writes": "sweep_best.txt"}))
    groups.append(Group("sweep", 2, 240, tuple(sweep)))
    return groups


def cpu_groups() -> list[Group]:
    """The same code at toy sizes on the CPU backend (XLA path; one case of the GPU kernel in the interpreter)."""
    b = CPU_BATCHES
    heads = (4, 2)
    probe = [
        _probe_named("probe", b["decode"], _shape(b["decode"], 128, "bfloat16", heads=heads), "xla"),
        _probe_named("probe", b["deep"], _shape(b["deep"], 64, "float32", heads=heads), "xla"),
        _probe_named("probe", b["prefill"], _shape(b["prefill"], 128, "int8", heads=heads), "xla"),
        _probe_named("probe", b["mixed"], _shape(b["mixed"], 256, "float8_e4m3fn", heads=heads), "xla"),
        _probe_named("probe", b["mixed"], _shape(b["mixed"], 64, "bfloat16", heads=heads), "pallas-gpu-interpret"),
    ]
    stacked = _shape(b["decode"], 128, "int8", heads=heads, num_layers=3, pages_per_layer=64)
    addr = dataclasses.replace(_probe(stacked, "xla"), name=f"addressing/3layers-top-pages-{_shape_name(stacked)}-xla")
    timing = _timing_case(
        "timing/decode-b4x200-d128-bfloat16-xla", _shape(b["decode"], 128, "bfloat16", heads=heads), "xla", 5
    )
    return [
        Group("env", 1, 60, (Case("env/devices", _env, {}),)),
        Group("bandwidth", 1, 60, (Case("bandwidth/copy-8MiB", _bandwidth(1 << 21), {"bytes": 2**24}),)),
        Group("probe", 1, 120, tuple(probe)),
        Group("exact", 1, 60, (_random_case(RANDOM_SPECS[2], "xla"),)),
        Group("addressing", 1, 60, (addr,)),
        Group("timing", 2, 60, (timing,)),
    ]


# What the device check leaves out, and why (summary.json's ``not_covered``).
NOT_COVERED = {
    "engine end to end": "imports flax, tqdm, jinja2, tokenizers, safetensors: not on the bare device image",
    "fused model step vs paged_jax.model.reference": "the model is a flax module: not on the bare device image",
    "cuDNN dot_product_attention baseline": "not built yet",
}


def groups_for(platform: str) -> list[Group]:
    return gpu_groups() if platform == "gpu" else cpu_groups()
