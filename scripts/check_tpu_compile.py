"""Ahead-of-time compile of the TPU kernels for real TPU targets, on a machine without a TPU.

With ``libtpu`` installed (``pip install -e '.[tpu]'``), ``jax.experimental.topologies.get_topology_desc``
describes a TPU slice; ``jax.jit(...).lower(...).compile()`` against its devices runs the real Mosaic
compiler, so layout, tiling, VMEM and DMA errors in the kernels show up here. Exits non-zero on any failure.

    .venv/bin/python scripts/check_tpu_compile.py [--topologies v5e:1x1 v6e:1x1] [--sharded v5e:2x2:4 v5e:2x4:8]

Every engine step here is the engine's own: the runner an ``LLMEngine`` builds for the config and engine options,
abstract (``paged_jax.engine.aot``: nothing allocated), and its own forward job, so a new operand of the step
needs no change here.

The KV audit (``--audit``, on by default) compiles the engine's whole jitted step for every shipped config
(tiny, llama-3.2-1b, llama-3.1-8b, qwen2.5-0.5b, mistral-7b, smollm2-135m) x TP 1, 4, 8 (where the model shards) x a
decode and a chunked-prefill bucket, then Llama-3.1-8B's verify step with n-gram speculation (k = 3: 256 tokens
and sample rows; its sampler too) and its decode step with LoRA (4 slots) at TP 1 and 4, with the KV pages sized
as the engine would size them on one chip, and
fails when the compiled HLO copies or transposes a KV page array (``paged_jax.worker.hlo_audit.kv_copies``:
any instruction producing a KV-shaped array other than the in-place scatter) or when the temporaries that grow
with the KV cache exceed 5% of one layer's KV pages. A failure names the config and the instruction.

``--quantized TOPOLOGY`` (default v5e:1x1) compiles the one-chip step of Llama-3.1-8B with int8 weights and int8
(and fp8_e4m3) KV pages next to the bfloat16 ones, prints per-chip memory and KV tokens, and fails below 100k
KV tokens for int8 + int8 (issue 16's goal), on a KV page copy, or past HBM; the kernel cases also compile
with quantized pages.

``--families [NAME ...]`` (default: all five) compiles one engine step (a 512-token chunked-prefill bucket) per
model family beyond Llama, at the real per-layer shapes of its shipped config with only a few layers (enough for
one global layer among Gemma's sliding ones): qwen3-8b (q/k norms), gemma-2-9b (soft caps, alternating
windows), gemma-3-4b (windows 5:1, two RoPE bases), mixtral-8x7b and qwen3-30b-a3b (an MoE layer; Qwen3-MoE
also at TP 4, experts split inside each expert). The same KV checks as the audit apply, and an MoE step must
lower its experts to XLA's grouped matmul (``ragged-dot-*`` fusions in the compiled HLO), not a dense product.
Run only this part with ``--topologies --sharded --quantized --no-audit`` (``--families`` with no names skips it).

``--sharded TOPOLOGY:TP`` also compiles the tensor-parallel engine step (``paged_jax.worker.sharding``) for
Llama-3.1-8B in bfloat16 on the first TP chips of that slice, with abstract parameters (nothing is
materialised), and prints a per-chip memory table from ``compiled.memory_analysis()``; the KV pages are
sized as the engine would size them on that chip (``--hbm-gib`` x 0.9 minus the weights).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
import time
import traceback

# Compiling needs libtpu, not a TPU; do not fight another process's libtpu lock (e.g. a test run nearby).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from paged_jax.worker.hlo_audit import kv_copies  # noqa: E402
from pallas_kernels.common import kv_pages_shape  # noqa: E402
from pallas_kernels.tpu_ragged_paged_attention import ragged_paged_attention_tpu  # noqa: E402

# (num_tokens, max_seqs, num_q_heads, num_kv_heads, head_dim, page_size, dtype, window, soft_cap)
CASES = [
    (16, 8, 8, 1, 64, 8, jnp.float32, None, None),  # MQA, smallest page
    (64, 64, 32, 8, 128, 16, jnp.bfloat16, None, None),  # decode bucket, GQA 4
    (256, 8, 8, 8, 128, 32, jnp.bfloat16, 128, None),  # prefill, GQA 1, sliding window
    (128, 16, 16, 2, 256, 64, jnp.bfloat16, None, 30.0),  # GQA 8, soft cap
    (32, 8, 4, 4, 64, 256, jnp.float32, None, None),  # largest page
    (64, 16, 8, 2, 128, 128, jnp.float32, 64, 50.0),
    (32, 8, 2, 1, 64, 16, jnp.bfloat16, None, None),  # bf16 with head_dim 64, MQA
    (16, 8, 4, 2, 256, 8, jnp.float32, 16, None),
    (64, 64, 9, 3, 64, 16, jnp.bfloat16, None, None),  # SmolLM2-135M decode: 3 query heads per KV head, hd 64
    (256, 8, 9, 3, 64, 16, jnp.float32, None, None),  # SmolLM2-135M prefill in float32 (the parity dtype)
]


# Quantized pages (int8 / fp8_e4m3 values with per-token scales, pallas_kernels.kv_quant): (case, page dtype)
QUANT_CASES = [
    (CASES[1], jnp.int8),  # Llama-3-8B-like decode bucket, 16-token pages
    (CASES[1], jnp.float8_e4m3fn),
    (CASES[2], jnp.int8),  # prefill with a sliding window
    (CASES[3], jnp.float8_e4m3fn),  # head_dim 256, soft cap
    (CASES[6], jnp.int8),  # head_dim 64, MQA
    (CASES[9], jnp.int8),  # SmolLM2 prefill, float32 queries
]


def compile_case(device, generation, case, kv_dtype=None) -> None:
    from pallas_kernels import kv_quant

    num_tokens, max_seqs, qh, kvh, d, page, dtype, window, cap = case
    max_blocks = max(2, 8192 // page)
    num_pages = max_seqs * max_blocks + 1
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=SingleDeviceSharding(device))
    args = (
        sds((num_tokens, qh, d), dtype),
        sds(kv_pages_shape(num_pages, kvh, page, d), dtype)
        if kv_dtype is None
        else kv_quant.QuantizedPages(
            sds(kv_pages_shape(num_pages, kvh, page, d), kv_dtype),
            sds(kv_quant.scales_shape(num_pages, kvh, page), jnp.float32),
        ),
        sds((max_seqs,), jnp.int32),
        sds((max_seqs, max_blocks), jnp.int32),
        sds((max_seqs + 1,), jnp.int32),
        sds((1,), jnp.int32),
    )
    fn = jax.jit(
        lambda *a: ragged_paged_attention_tpu(
            *a, sm_scale=d**-0.5, soft_cap=cap, sliding_window=window, generation=generation
        )
    )
    # Tells Pallas which TPU it lowers for (the default backend here is the CPU).
    mesh = jax.sharding.Mesh([device], ("x",))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        fn.lower(*args).compile()


HBM_GIB = {"v5e": 16.0, "v6e": 32.0, "v5p": 95.0, "v4": 32.0}  # per chip
SHARDED_STEPS = ("decode", "prefill")  # paged_jax.engine.aot.step_shape


def compile_step(
    topo: str,
    tp: int,
    config_name,
    kind: str,
    hbm_gib: float | None = None,
    num_pages: int | None = None,
    quantization: str | None = None,
    kv_dtype: str | None = None,
    options: tuple[tuple[str, object], ...] = (),
):
    """Compile the engine's own forward step of `kind` (``paged_jax.engine.aot.step_shape``: decode, prefill,
    verify) for `config_name` on the first `tp` chips of `topo` (one chip: no mesh).

    The runner is the one an engine builds (``paged_jax.engine.aot.abstract_engine``): abstract parameters and
    pages (nothing is materialised), the pages sized as the engine would size them on that chip (HBM x 0.9 minus
    the weights) unless `num_pages` is given. `quantization` (int8 | fp8 weights, the TPU's cast matmul),
    `kv_dtype` (int8 | fp8_e4m3 pages with scales) and `options` (more ``EngineConfig`` fields: LoRA,
    speculation) compile those engines' steps. Returns ``(compiled, facts)`` with per-chip sizes.
    `config_name` is a shipped config's name or a `ModelConfig`."""
    from paged_jax.config import ModelConfig, load_model_config
    from paged_jax.config.engine import EngineConfig
    from paged_jax.engine.aot import abstract_engine, step_job, step_shape

    dims = tuple(int(x) for x in topo.split(":")[1].split("x"))
    # One host holds the whole slice (a v5e-4 or v5e-8 host), as for one engine of `paged-jax generate`.
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topo, chips_per_host_bounds=(*dims, 1)[:3])
    hbm_gib = hbm_gib or HBM_GIB[topo.split(":")[0]]
    config = config_name if isinstance(config_name, ModelConfig) else load_model_config(config_name)
    ec = EngineConfig(
        attention_backend="pallas-tpu", tensor_parallel_size=tp, num_pages=num_pages, kv_dtype=kv_dtype, **dict(options)
    )
    weights = None if quantization is None else (quantization, True, False)
    engine = abstract_engine(config, ec, desc.devices[:tp], int(hbm_gib * 2**30), weights)
    compiled = engine.compile(step_job(engine.runner, kind))
    tokens, seqs = step_shape(engine.runner, kind)
    facts = {
        "engine": engine,
        "tokens": tokens,
        "seqs": seqs,
        "weights": engine.weights_bytes,
        "layer_kv": engine.layer_kv_bytes,
        "kv_tokens": engine.kv_tokens,
        "local_kv_shape": engine.local_kv_shape,
        "dtype": engine.runner.kv_dtype,
        "num_layers": engine.runner.config.num_layers,
    }
    return compiled, facts


AUDIT_CONFIGS = ("tiny", "llama-3.2-1b", "llama-3.1-8b", "qwen2.5-0.5b", "mistral-7b", "smollm2-135m")
AUDIT_KINDS = ("decode", "prefill")  # paged_jax.engine.aot.step_shape: 64 x 64 and 512 x 64 at the defaults
_NGRAM = (("speculative_config", {"method": "ngram", "num_speculative_tokens": 3}),)
_LORA = (("enable_lora", True), ("max_loras", 4))
# Engines beyond the plain ones: (config, TP, step kind, EngineConfig options, label). The verify step's
# sampler (rejected rows marked on the device) is compiled with it.
AUDIT_ENGINES = (
    ("llama-3.1-8b", 1, "verify", _NGRAM, "ngram k=3"),
    ("llama-3.1-8b", 1, "decode", _LORA, "lora x4"),
    ("llama-3.1-8b", 4, "decode", _LORA, "lora x4"),
)
AUDIT_TOPOLOGY = {1: "v6e:1x1", 4: "v6e:2x2", 8: "v6e:2x4"}  # 32 GiB chips: an 8B model fits one
MAX_TEMP_FRACTION = 0.05  # temporaries that grow with the KV cache, of one layer's KV pages (see audit())


def audit_engines(configs=AUDIT_CONFIGS, tps=(1, 4, 8)) -> list[tuple]:
    """Every (config, TP, kind, options, label) the audit compiles: each config at each TP it shards to, in a
    decode and a prefill bucket, then :data:`AUDIT_ENGINES`."""
    from paged_jax.config import load_model_config
    from paged_jax.worker import sharding as shd

    out = []
    for config_name in configs:
        for tp in tps:
            try:
                if tp > 1:
                    shd.kv_replication(load_model_config(config_name), tp)
            except ValueError:
                continue  # the model does not shard this way
            out += [(config_name, tp, kind, (), "") for kind in AUDIT_KINDS]
    return out + [e for e in AUDIT_ENGINES if e[0] in configs and e[1] in tps]


def audit(configs=AUDIT_CONFIGS, tps=(1, 4, 8)) -> int:
    """The compiled-step KV audit (see the module docstring); prints a table, returns the failure count.

    When temporaries exceed the bound they are measured again with a 64-page cache. The difference is the
    part that grows with the KV cache (a copy or relayout of a page array, whole or in part); it must
    stay under 5% of one layer's KV pages. What does not grow with the cache (the step's activations, the
    replicated logits and, with TP, their relayout after the all-gather: 33 MB for a 64-sequence Llama-3
    bucket, seen in the buffer assignment) is reported, not bounded."""
    from paged_jax.engine.aot import verify_sample_job

    failures = 0
    print(
        "\nKV audit of the compiled engine step (v6e; bucket = tokens x seqs; temp at the engine's page count"
        " and, when over 5% of one layer's KV, at 64 pages; growth = their difference / one layer's KV)"
    )
    print(
        f"{'config':<14}{'engine':<10}{'TP':>3}{'step':>8}{'bucket':>9}{'KV shape/chip':>28}{'copies':>7}"
        f"{'temp MiB':>10}{'at 64 pages':>12}{'layer KV MiB':>13}{'growth':>8}"
    )
    for config_name, tp, kind, options, label in audit_engines(configs, tps):
        name = f"{config_name} {label} TP{tp} {kind}"
        topo = AUDIT_TOPOLOGY[tp]
        try:
            compiled, facts = compile_step(topo, tp, config_name, kind, options=options)
            temp = compiled.memory_analysis().temp_size_in_bytes
            temp_small = 0  # all of temp may be growth: fine when under the bound already
            if temp > MAX_TEMP_FRACTION * facts["layer_kv"]:
                small, _ = compile_step(topo, tp, config_name, kind, num_pages=64, options=options)
                temp_small = small.memory_analysis().temp_size_in_bytes
            if kind == "verify":
                engine = facts["engine"]
                engine.compile(verify_sample_job(engine.runner))
        except Exception:  # noqa: BLE001 - every compiler error is a failure to report
            failures += 1
            print(f"FAIL {name}\n{traceback.format_exc(limit=4)}")
            continue
        bad = kv_copies(compiled.as_text(), facts["local_kv_shape"], facts["dtype"])
        growth = max(0, temp - temp_small) / facts["layer_kv"]
        shape = "x".join(str(d) for d in facts["local_kv_shape"])
        print(
            f"{config_name:<14}{label:<10}{tp:>3}{kind:>8}{f'{facts["tokens"]}x{facts["seqs"]}':>9}{shape:>28}"
            f"{len(bad):>7}{temp / 2**20:>10.1f}{temp_small / 2**20:>12.1f}{facts['layer_kv'] / 2**20:>13.1f}"
            f"{growth:>8.2%}"
        )
        for line in bad[:4]:
            print(f"FAIL {name}: KV copy: {line}")
        if growth > MAX_TEMP_FRACTION:
            print(
                f"FAIL {name}: temporaries grow by {(temp - temp_small) / 2**20:.1f} MiB with the KV cache,"
                f" over {MAX_TEMP_FRACTION:.0%} of one layer's KV pages"
            )
        failures += bool(bad) + (growth > MAX_TEMP_FRACTION)
    return failures


# XLA TPU compiles a ragged-dot into grouped-matmul fusions named ragged-dot-* (beside one ragged-dot-metadata
# custom call that builds the group offsets); a dense fallback would show none.
GROUPED_MATMUL = re.compile(r"^\s*(?:ROOT )?%ragged-dot-(?!metadata)[\w.\-]* = ", re.M)
FAMILY_STEPS = {  # family config -> TP degrees to compile its step at
    "qwen3-8b": (1,),
    "gemma-2-9b": (1,),
    "gemma-3-4b": (1,),
    "mixtral-8x7b": (1,),
    "qwen3-30b-a3b": (1, 4),
}


def check_families(names=tuple(FAMILY_STEPS), kind: str = "prefill") -> int:
    """One engine step per family (module docstring), with the audit's KV checks; returns the failure count."""
    from paged_jax.config import load_model_config

    failures = 0
    print(f"\nmodel families: the engine's {kind} step at each family's real layer shapes, few layers, v6e")
    print(
        f"{'config':<15}{'layers':>7}{'TP':>3}{'copies':>7}{'temp MiB':>10}{'layer KV MiB':>13}{'ragged-dot':>11}"
        f"{'time':>7}  features"
    )
    for config_name in names:
        full = load_model_config(config_name)
        config = full.replace(num_layers=max(2, full.sliding_window_pattern))
        for tp in FAMILY_STEPS[config_name]:
            t0 = time.perf_counter()
            name = f"{config_name} TP{tp}"
            try:
                compiled, facts = compile_step(AUDIT_TOPOLOGY[tp], tp, config, kind)
            except Exception:  # noqa: BLE001 - every compiler error is a failure to report
                failures += 1
                print(f"FAIL {name}\n{traceback.format_exc(limit=4)}")
                continue
            hlo = compiled.as_text()
            bad = kv_copies(hlo, facts["local_kv_shape"], facts["dtype"])
            temp = compiled.memory_analysis().temp_size_in_bytes
            grouped = len(GROUPED_MATMUL.findall(hlo))
            print(
                f"{config_name:<15}{config.num_layers:>7}{tp:>3}{len(bad):>7}{temp / 2**20:>10.1f}"
                f"{facts['layer_kv'] / 2**20:>13.1f}{grouped:>11}{time.perf_counter() - t0:>6.0f}s  "
                f"{config.family_summary()}"
            )
            for line in bad[:4]:
                print(f"FAIL {name}: KV copy: {line}")
            if config.is_moe and not grouped:
                print(f"FAIL {name}: the experts did not lower to ragged-dot (grouped matmul)")
            failures += bool(bad) + (config.is_moe and not grouped)
    return failures


def sharded_memory(topo: str, tp: int, config_name: str, kind: str, hbm_gib: float) -> dict[str, float]:
    """Per-chip GiB of the compiled TP step (the memory table of ``--sharded``)."""
    compiled, facts = compile_step(topo, tp, config_name, kind, hbm_gib)
    m = compiled.memory_analysis()
    hlo = compiled.as_text()
    gib = 2**-30
    return {
        "tokens": facts["tokens"],
        "seqs": facts["seqs"],
        "weights": facts["weights"] * gib,
        "kv": facts["layer_kv"] * facts["num_layers"] * gib,
        "kv_tokens": facts["kv_tokens"],
        "args": m.argument_size_in_bytes * gib,
        "out": m.output_size_in_bytes * gib,
        "alias": m.alias_size_in_bytes * gib,
        "temp": m.temp_size_in_bytes * gib,
        "peak": (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)
        * gib,
        "all-reduce": hlo.count(" all-reduce("),
        "all-gather": hlo.count(" all-gather("),
    }


def check_sharded(specs: list[str], config_name: str, hbm_gib: float | None) -> int:
    """Compile and print the per-chip memory table for each `TOPOLOGY:TP`; returns the failure count."""
    failures = 0
    print(
        f"\nper-chip memory of the TP step, {config_name} bfloat16, GiB (args = weights + KV + metadata; "
        "out aliases the donated KV; peak = args + out - alias + temp)"
    )
    print(
        f"{'target':<14}{'TP':>3}{'tokens':>7}{'seqs':>5}{'weights':>9}{'KV':>8}{'KV tokens':>11}{'args':>8}"
        f"{'temp':>8}{'peak':>8}{'HBM':>6}  collectives"
    )
    for spec in specs:
        topo, tp = spec.rsplit(":", 1)
        hbm = hbm_gib or HBM_GIB[topo.split(":")[0]]
        for kind in SHARDED_STEPS:
            t0 = time.perf_counter()
            try:
                r = sharded_memory(topo, int(tp), config_name, kind, hbm)
            except Exception:  # noqa: BLE001 - every compiler error is a failure to report
                failures += 1
                print(f"FAIL {spec} {kind}\n{traceback.format_exc(limit=4)}")
                continue
            print(
                f"{topo:<14}{tp:>3}{r['tokens']:>7}{r['seqs']:>5}{r['weights']:>9.2f}{r['kv']:>8.2f}"
                f"{r['kv_tokens']:>11,}{r['args']:>8.2f}{r['temp']:>8.2f}{r['peak']:>8.2f}{hbm:>6.0f}  "
                f"{r['all-reduce']} all-reduce, {r['all-gather']} all-gather  "
                f"({time.perf_counter() - t0:.0f}s)"
            )
            if r["peak"] > hbm:
                failures += 1
                print(f"FAIL {spec}: peak {r['peak']:.2f} GiB exceeds {hbm} GiB")
    return failures


QUANTIZED_STEPS = ("decode", "prefill")  # paged_jax.engine.aot.step_shape
MIN_QUANTIZED_KV_TOKENS = 100_000  # issue 16's goal for Llama-3.1-8B int8 + int8 KV on one v5e chip


def check_quantized(topo: str, config_name: str, hbm_gib: float | None) -> int:
    """Compile the one-chip engine step of `config_name` with int8 weights and int8 KV pages, print per-chip
    memory, and fail if the peak exceeds HBM, a KV page array is copied, or fewer than 100k KV tokens fit."""
    failures = 0
    hbm = hbm_gib or HBM_GIB[topo.split(":")[0]]
    print(f"\nper-chip memory of the quantized step, {config_name} on {topo} ({hbm:.0f} GiB), GiB")
    print(
        f"{'weights':<8}{'KV':<10}{'tokens':>7}{'seqs':>5}{'weights':>9}{'KV':>8}{'KV tokens':>11}{'temp':>8}"
        f"{'peak':>8}{'copies':>7}"
    )
    # bfloat16 weights (15 GiB for the 8B) do not fit a 16 GiB chip at all: XLA refuses the step (RESOURCE_EXHAUSTED).
    for quantization, kv_dtype in (("int8", "int8"), ("int8", "fp8_e4m3")):
        for kind in QUANTIZED_STEPS:
            name = f"{config_name} w={quantization} kv={kv_dtype} {kind}"
            t0 = time.perf_counter()
            try:
                compiled, facts = compile_step(
                    topo, 1, config_name, kind, hbm, quantization=quantization, kv_dtype=kv_dtype
                )
            except Exception:  # noqa: BLE001 - every compiler error is a failure to report
                failures += 1
                print(f"FAIL {name}\n{traceback.format_exc(limit=4)}")
                continue
            m = compiled.memory_analysis()
            gib = 2**-30
            peak = (
                m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
            ) * gib
            bad = kv_copies(compiled.as_text(), facts["local_kv_shape"], facts["dtype"])
            print(
                f"{quantization or 'bf16':<8}{kv_dtype or 'bf16':<10}{facts['tokens']:>7}{facts['seqs']:>5}"
                f"{facts['weights'] * gib:>9.2f}{facts['layer_kv'] * facts['num_layers'] * gib:>8.2f}"
                f"{facts['kv_tokens']:>11,}{m.temp_size_in_bytes * gib:>8.2f}{peak:>8.2f}{len(bad):>7}"
                f"  ({time.perf_counter() - t0:.0f}s)"
            )
            for line in bad[:4]:
                print(f"FAIL {name}: KV copy: {line}")
            failures += bool(bad) + (peak > hbm)
            if peak > hbm:
                print(f"FAIL {name}: peak {peak:.2f} GiB exceeds {hbm} GiB")
            if quantization == "int8" and kv_dtype == "int8" and facts["kv_tokens"] < MIN_QUANTIZED_KV_TOKENS:
                failures += 1
                print(f"FAIL {name}: {facts['kv_tokens']:,} KV tokens < {MIN_QUANTIZED_KV_TOKENS:,}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", nargs="*", default=["v5e:1x1", "v6e:1x1"])
    parser.add_argument(
        "--sharded",
        nargs="*",
        default=["v5e:2x2:4", "v5e:2x4:8"],
        metavar="TOPOLOGY:TP",
        help="tensor-parallel engine steps to compile (none: skip)",
    )
    parser.add_argument("--sharded-model", default="llama-3.1-8b")
    parser.add_argument("--no-audit", dest="audit", action="store_false", help="skip the compiled-step KV audit")
    parser.add_argument(
        "--families",
        nargs="*",
        default=list(FAMILY_STEPS),
        choices=list(FAMILY_STEPS),
        metavar="CONFIG",
        help="family engine steps to compile (none: skip)",
    )
    parser.add_argument("--hbm-gib", type=float, default=None, help="per-chip HBM (default: by TPU generation)")
    parser.add_argument(
        "--quantized",
        nargs="*",
        default=["v5e:1x1"],
        metavar="TOPOLOGY",
        help="one-chip steps with int8/fp8 weights and KV pages to compile (none: skip)",
    )
    parser.add_argument("--quantized-model", default="llama-3.1-8b")
    args = parser.parse_args()
    failures = 0
    for topo in args.topologies:
        try:
            # One host per chip so that 1x1 slices are valid.
            desc = topologies.get_topology_desc(platform="tpu", topology_name=topo, chips_per_host_bounds=(1, 1, 1))
        except Exception as e:  # noqa: BLE001 - report and count any failure to get the target
            print(f"FAIL {topo}: no topology ({type(e).__name__}: {e})")
            failures += 1
            continue
        device = desc.devices[0]
        generation = topo.split(":")[0]
        for case, kv_dtype in [(c, None) for c in CASES] + QUANT_CASES:
            name = (
                f"{topo} {device.device_kind!r} "
                + " ".join(str(getattr(x, "__name__", x)) for x in itertools.chain(case))
                + ("" if kv_dtype is None else f" pages={jnp.dtype(kv_dtype).name}")
            )
            t0 = time.perf_counter()
            try:
                compile_case(device, generation, case, kv_dtype)
                print(f"ok   {name} ({time.perf_counter() - t0:.1f}s)")
            except Exception:  # noqa: BLE001 - every compiler error is a failure to report
                failures += 1
                print(f"FAIL {name}\n{traceback.format_exc(limit=3)}")
    if args.audit:
        failures += audit()
    if args.families:
        failures += check_families(args.families)
    if args.sharded:
        failures += check_sharded(args.sharded, args.sharded_model, args.hbm_gib)
    for topo in args.quantized or ():
        failures += check_quantized(topo, args.quantized_model, args.hbm_gib)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
