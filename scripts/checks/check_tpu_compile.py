"""Ahead-of-time compile of the TPU kernels for real TPU targets, on a machine without a TPU.

With ``libtpu`` installed (``pip install -e '.[tpu]'``), ``jax.experimental.topologies.get_topology_desc``
describes a TPU slice; ``jax.jit(...).lower(...).compile()`` against its devices runs the real Mosaic
compiler, so layout, tiling, VMEM and DMA errors in the kernels show up here. Exits non-zero on any failure.

The kernel sweep (``CASES``) takes every value of every axis (head_dim, page size, page dtype, KV heads, query
group, max_model_len, bucket kind) and the pairs that interact (head_dim x group, page dtype x page size), 16
cases on the first ``--topologies`` target (v6e) and 8 that still take every axis value on the others (v5e),
and checks that block tables too large for SMEM are refused with an error naming the
engine fields (``pallas_kernels.tpu.limits``) rather than failing in Mosaic. On every target it also compiles the
gated delta rule kernels at Qwen3.5-9B's linear-attention shapes (``gated_delta_tpu.py``: prefill 4 x 512,
chunked prefill with decodes, decode 64 and 256, float32 inputs), with the state pool audited for copies.

    .venv/bin/python scripts/checks/check_tpu_compile.py [--topologies v6e:1x1 v5e:1x1] [--sharded v5e:2x2:4 v5e:2x4:8]

Every engine step here is the engine's own: the runner an ``LLMEngine`` builds for the config and engine options,
abstract (``paged_jax.engine.aot``: nothing allocated), and its own forward job, so a new operand of the step
needs no change here.

The KV audit (``--audit``, on by default) compiles the engine's whole jitted step for every shipped config
(tiny, llama-3.2-1b, llama-3.1-8b, qwen2.5-0.5b, smollm2-135m; Mistral-7B's layers are Llama-3.1-8B's) x TP
1, 4, 8 (where the model shards) x a decode and a chunked-prefill bucket, then Llama-3.1-8B's verify step with
n-gram speculation (k = 3: 256 tokens and sample rows; its sampler too) and its decode step with LoRA (4 slots)
at TP 1 and 4, and Qwen2.5-0.5B's decode step with int8 pages, with the KV pages sized as the engine would size
them on one chip, then small caches (explicit ``num_pages``: page arrays of 4-32 MiB, which fit VMEM; scanned
and unrolled, bf16, float32 and int8 pages), and Gemma-3-4B's hybrid KV steps (its KV cache groups: decode and
prefill at both sizes, ``HYBRID_KV_ENGINES``), and fails when the compiled HLO copies or transposes a KV page
array or a quantized cache's scale array (``paged_jax.worker.hlo_audit.cache_copies``: any instruction
producing an array of that shape other than in place, a staging in VMEM included) or when the temporaries that
grow with the KV cache exceed 5% of one layer's KV pages, or when the step copies any per-layer weight to HBM
(column ``w-copy``, MiB per step beside the weights' size: ``paged_jax.worker.hlo_audit.weight_copies``, e.g. a
scanned decoder's dynamic-slice of a stacked weight written out or relaid out before its dot; every dot must
read its weight in place, as ``check_gpu_compile.py`` requires, except the family steps listed with their
figure and cause in ``WEIGHT_COPY_ALLOWED``, which fail above it). A failure names the config and the instruction.

``--quantized TOPOLOGY`` (default v5e:1x1) compiles the one-chip step of Llama-3.1-8B with int8 weights and int8
(and fp8_e4m3) KV pages next to the bfloat16 ones, prints per-chip memory and KV tokens, and fails below 100k
KV tokens for int8 + int8 (issue 16's goal), on a KV page copy, or past HBM; the kernel cases also compile
with quantized pages.

``--families [NAME ...]`` (default: all five) compiles one engine step (a 512-token chunked-prefill bucket) per
model family beyond Llama, at the real per-layer shapes of its shipped config with only a few layers (Gemma: two
periods of its window pattern and one layer more, so the scanned step has a repeated group and a remainder):
qwen3-8b (q/k norms), gemma-2-9b (soft caps, alternating windows), gemma-3-4b (windows 5:1, two RoPE bases),
mixtral-8x7b and qwen3-30b-a3b (an MoE layer; Qwen3-MoE also at TP 4, experts split inside each expert). The
same KV and weight-copy checks as the audit apply, and an MoE step must lower its experts to XLA's grouped matmul
(``ragged-dot-*`` fusions in the compiled HLO), not a dense product.
Run only this part with ``--topologies --sharded --quantized --no-audit`` (``--families`` with no names skips it).

``--hybrid LAYERS`` (off by default: minutes on two cores) compiles the engine's decode and prefill steps of
``configs/qwen3.5-9b.json`` (a linear-attention hybrid) with its first LAYERS layers on v6e, and its state-row
copy job, and fails on a copy of a KV page array or of a state-pool array (conv or recurrent rows), on a layer
weight copied, and on a step that does not run the gated delta and conv-row kernels (:func:`check_hybrid`).

``--sharded TOPOLOGY:TP`` also compiles the tensor-parallel engine step (``paged_jax.worker.sharding``) for
Llama-3.1-8B in bfloat16 on the first TP chips of that slice, with abstract parameters (nothing is
materialised), and prints a per-chip memory table from ``compiled.memory_analysis()``; the KV pages are
sized as the engine would size them on that chip (``--hbm-gib`` x 0.9 minus the weights).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import traceback
from typing import NamedTuple

# Compiling needs libtpu, not a TPU; do not fight another process's libtpu lock (e.g. a test run nearby).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # its sibling modules, also when loaded by path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gated_delta_tpu  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from paged_jax.engine.aot import layer_weight_shapes  # noqa: E402
from paged_jax.worker.hlo_audit import cache_copies, weight_copies  # noqa: E402
from pallas_kernels.common import kv_pages_shape  # noqa: E402
from pallas_kernels.tpu.ragged_paged_attention import ragged_paged_attention_tpu  # noqa: E402


class KernelCase(NamedTuple):
    """One kernel shape of the sweep: a bucket (tokens x sequences) of a model shape and cache layout."""

    num_tokens: int
    max_seqs: int
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    page_size: int
    dtype: object  # queries (and unquantized pages)
    kv_dtype: object | None  # int8 / fp8_e4m3 pages with scales; None: pages in `dtype`
    max_model_len: int  # max_blocks = max_model_len / page_size: the block table's width
    window: int | None = None
    soft_cap: float | None = None

    def __str__(self) -> str:
        pages = "" if self.kv_dtype is None else f" pages={jnp.dtype(self.kv_dtype).name}"
        return (
            f"{self.num_tokens}x{self.max_seqs} kv{self.num_kv_heads} g{self.group} d{self.head_dim} p{self.page_size}"
            f" {jnp.dtype(self.dtype).name}{pages} len{self.max_model_len // 1024}k"
            + (f" w{self.window}" if self.window else "")
            + (f" cap{self.soft_cap:g}" if self.soft_cap else "")
        )


BF16, F32, I8, F8 = jnp.bfloat16, jnp.float32, jnp.int8, jnp.float8_e4m3fn
K = 1024
# The kernel sweep (issue 24): every value of every axis -- head_dim {64, 128, 256}, page size {8, 16, 64, 128},
# pages {bf16, int8, fp8} (and float32), KV heads {1, 2, 8}, query groups {1, 3, 4, 7, 8}, max_model_len {2k,
# 32k, 128k}, decode / prefill / mixed buckets -- and the pairs that interact: every head_dim x group (15
# cases), every page dtype x page size (int8 and fp8 at 8 and 16 tokens fill a quarter or half of a (32, 128)
# tile), long max_model_len with many sequences (the block table in SMEM: pallas_kernels.tpu.limits). Buckets:
# decode = tokens == sequences, prefill = 256-512 tokens of 8 sequences, mixed = 128 tokens of 16-32.
CASES = [
    KernelCase(64, 64, 8, 1, 64, 8, BF16, None, 2 * K),  # decode
    KernelCase(256, 8, 1, 3, 64, 16, BF16, I8, 32 * K),  # prefill, int8 at half a tile
    KernelCase(128, 32, 2, 4, 64, 64, BF16, F8, 128 * K),  # mixed
    KernelCase(512, 8, 8, 7, 64, 128, BF16, None, 2 * K, 64, 50.0),
    KernelCase(128, 16, 1, 8, 64, 8, BF16, I8, 32 * K),  # int8 at a quarter tile
    KernelCase(16, 16, 2, 1, 128, 16, BF16, F8, 128 * K),  # decode, 8192-page tables
    KernelCase(128, 32, 8, 3, 128, 64, BF16, None, 32 * K, 128),
    KernelCase(64, 64, 8, 4, 128, 16, BF16, None, 8 * K),  # Llama-3-8B decode
    KernelCase(256, 8, 1, 7, 128, 8, BF16, F8, 2 * K),
    KernelCase(128, 64, 2, 8, 128, 128, BF16, I8, 128 * K),  # 64 sequences x 1024 pages
    KernelCase(128, 32, 1, 1, 256, 64, BF16, I8, 2 * K, None, 30.0),
    KernelCase(32, 32, 2, 3, 256, 128, BF16, F8, 32 * K),
    KernelCase(512, 16, 8, 4, 256, 16, BF16, None, 128 * K, 256),  # head_dim 256 x 8 KV heads: VMEM-heavy
    KernelCase(128, 32, 1, 7, 256, 8, F32, None, 32 * K),  # float32 pages
    KernelCase(256, 8, 2, 8, 256, 64, F32, None, 2 * K, None, 30.0),
    KernelCase(256, 8, 3, 3, 64, 16, F32, I8, 8 * K),  # SmolLM2-135M prefill, float32 queries (the parity dtype)
    # int8 at page 128 with 32 KV heads: the scale rows' per-key temporaries ([kv_block, 2 x 32 x 128] each) are in
    # the VMEM plan, which takes one page per block (Mosaic refused the two-page plan: scoped VMEM OOM)
    KernelCase(512, 16, 32, 1, 128, 128, BF16, I8, 32 * K),
]
# The sweep's second generation (v5e, beside v6e's full sweep): 8 of the cases that still take every value of
# every axis (the pairs are v6e's), since the block sizes and limits differ by generation but the pairs' reasons
# (tiles, SMEM) do not.
SECOND_GENERATION_CASES = [CASES[i] for i in (0, 1, 9, 10, 11, 12, 13, 15, 16)]
# Shapes the SMEM guard must refuse with a clear error before Mosaic sees them (never compiled):
# (max_seqs, page_size, max_model_len).
SMEM_REFUSED = [(64, 16, 128 * K), (256, 64, 128 * K)]
_MAX_SWEEP_PAGES = 2**16 + 1  # page arrays as a large engine would have, without sizing each to its table


def _case_args(device, case: KernelCase):
    from pallas_kernels import kv_quant

    max_blocks = case.max_model_len // case.page_size
    num_pages = min(case.max_seqs * max_blocks + 1, _MAX_SWEEP_PAGES)
    qh, kvh, d, page = case.group * case.num_kv_heads, case.num_kv_heads, case.head_dim, case.page_size
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=SingleDeviceSharding(device))
    pages_shape = kv_pages_shape(num_pages, kvh, page, d)
    pages = (
        sds(pages_shape, case.dtype)
        if case.kv_dtype is None
        else kv_quant.QuantizedPages(
            sds(pages_shape, case.kv_dtype), sds(kv_quant.scales_shape(num_pages, kvh, page, True), jnp.float32)
        )
    )
    return (
        sds((case.num_tokens, qh, d), case.dtype),
        pages,
        sds((case.max_seqs,), jnp.int32),
        sds((case.max_seqs, max_blocks), jnp.int32),
        sds((case.max_seqs + 1,), jnp.int32),
        sds((1,), jnp.int32),
    )


def lower_case(device, generation, case: KernelCase):
    """The kernel of `case` lowered for `device` (Pallas reads the target from the abstract mesh)."""
    fn = jax.jit(
        lambda *a: ragged_paged_attention_tpu(
            *a, sm_scale=case.head_dim**-0.5, soft_cap=case.soft_cap, sliding_window=case.window, generation=generation
        )
    )
    mesh = jax.sharding.Mesh([device], ("x",))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return fn.lower(*_case_args(device, case))


def compile_case(device, generation, case: KernelCase) -> None:
    lower_case(device, generation, case).compile()


def check_kernels(topo: str, cases: list[KernelCase], gated_delta: bool = True) -> int:
    """Compile each of `cases` for `topo` and check the SMEM guard's refusals; returns the failure count."""
    try:
        # One host per chip so that 1x1 slices are valid.
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topo, chips_per_host_bounds=(1, 1, 1))
    except Exception as e:  # noqa: BLE001 - report and count any failure to get the target
        print(f"FAIL {topo}: no topology ({type(e).__name__}: {e})")
        return 1
    device, generation = desc.devices[0], topo.split(":")[0]
    failures = 0
    for case in cases:
        name = f"{topo} {device.device_kind!r} {case}"
        t0 = time.perf_counter()
        try:
            compile_case(device, generation, case)
            print(f"ok   {name} ({time.perf_counter() - t0:.1f}s)")
        except Exception:  # noqa: BLE001 - every compiler error is a failure to report
            failures += 1
            print(f"FAIL {name}\n{traceback.format_exc(limit=3)}")
    for seqs, page, length in SMEM_REFUSED:
        case = KernelCase(seqs, seqs, 8, 4, 128, page, BF16, None, length)
        try:
            lower_case(device, generation, case)
        except ValueError as e:
            if "SMEM" in str(e) and "max_num_seqs" in str(e):
                print(f"ok   {topo} {case}: refused ({str(e)[:90]}...)")
                continue
            raise
        failures += 1
        print(f"FAIL {topo} {case}: a block table over SMEM was not refused")
    if gated_delta:
        failures += gated_delta_tpu.check(device, generation)
    return failures


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
    fields = {"attention_backend": "pallas-tpu", "tensor_parallel_size": tp, **dict(options)}
    fields.update({k: v for k, v in (("num_pages", num_pages), ("kv_dtype", kv_dtype)) if v is not None})
    ec = EngineConfig(**fields)
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
        # every array of a layer's cache the audit checks for copies: the pages, and quantized pages' scales
        "cache_arrays": [(engine.local_kv_shape, engine.runner.kv_dtype)]
        + ([(engine.local_scales_shape, jnp.float32)] if engine.local_scales_shape else []),
        "num_layers": engine.runner.config.num_layers,
    }
    return compiled, facts


# Mistral-7B is not compiled: its layers are Llama-3.1-8B's (GQA 4, head_dim 128, the same MLP), only the
# vocabulary differs, and no KV or memory property of the step depends on it.
AUDIT_CONFIGS = ("tiny", "llama-3.2-1b", "llama-3.1-8b", "qwen2.5-0.5b", "smollm2-135m")
AUDIT_KINDS = ("decode", "prefill")  # paged_jax.engine.aot.step_shape: 64 x 64 and 512 x 64 at the defaults
_NGRAM = (("speculative_config", {"method": "ngram", "num_speculative_tokens": 3}),)
_LORA = (("enable_lora", True), ("max_loras", 4))
# Engines beyond the plain ones: (config, TP, step kind, EngineConfig options, label). The verify step's
# sampler (rejected rows marked on the device) is compiled with it.
AUDIT_ENGINES = (
    ("llama-3.1-8b", 1, "verify", _NGRAM, "ngram k=3"),
    ("llama-3.1-8b", 1, "decode", _LORA, "lora x4"),
    ("llama-3.1-8b", 4, "decode", _LORA, "lora x4"),
    # int8 pages at full size with 64-column scale rows (2 KV heads x 16 slots x K/V): before rows were padded
    # to whole lanes (pallas_kernels.kv_quant.scale_row_width) XLA relayouted every layer's whole scale array.
    ("qwen2.5-0.5b", 1, "decode", (("kv_dtype", "int8"),), "int8 KV"),
)
# Small caches (explicit num_pages): a page array of a few MiB fits VMEM, where XLA once staged every layer's
# whole array in and out on every step (pallas_kernels.tpu.ragged_paged_attention._in_hbm). Qwen2.5-0.5B at
# 2,049 pages (16 MiB per layer, bf16, unrolled: 24 copies before the fix), and tiny (2 layers: fast to
# compile) at 1,025 pages (16 MiB per layer in float32) scanned (one stacked 32 MiB array) and unrolled in a
# prefill bucket. And tiny with int8 pages at 1,025 pages (4.5 MiB per layer), scanned: XLA staged the
# scale arrays (0.5 MiB per layer) in VMEM for their scatter and copied them back, at any size that fits VMEM
# (up to tens of MiB), until the scales were written by a Pallas kernel in HBM (pallas_kernels.tpu.scale_write).
SMALL_CACHE_ENGINES = (
    ("qwen2.5-0.5b", 1, "decode", (("num_pages", 2049), ("scan_layers", "off")), "2049p"),
    ("tiny", 1, "decode", (("num_pages", 1025), ("scan_layers", "on")), "1025p scan"),
    ("tiny", 1, "prefill", (("num_pages", 1025), ("scan_layers", "off")), "1025p"),
    ("tiny", 1, "decode", (("num_pages", 1025), ("scan_layers", "on"), ("kv_dtype", "int8")), "int8 1025p"),
)
# Hybrid KV (paged_jax.kv_cache.groups): Gemma-3-4B's 34 layers as 1 full-attention group of 5 layers and 6
# sliding-window groups (5, 5, 5, 5, 5, 4), pages of 5 layer slabs in one stacked array, each scanned layer
# indexing its group's row of the [G, S, max_blocks] block tables: decode and chunked prefill at the engine's page
# count (4.5 GiB per slab array on a v6e chip) and at a small cache (257 pages: 16 MiB per slab array, the size XLA
# once staged through VMEM whole).
HYBRID_KV_ENGINES = (
    ("gemma-3-4b", 1, "decode", (), "hybrid KV"),
    ("gemma-3-4b", 1, "prefill", (), "hybrid KV"),
    ("gemma-3-4b", 1, "decode", (("num_pages", 257),), "hybrid 257p"),
    ("gemma-3-4b", 1, "prefill", (("num_pages", 257),), "hybrid 257p"),
)
AUDIT_TOPOLOGY = {1: "v6e:1x1", 4: "v6e:2x2", 8: "v6e:2x4"}  # 32 GiB chips: an 8B model fits one
MAX_TEMP_FRACTION = 0.05  # temporaries that grow with the KV cache, of one layer's KV pages (see audit())


def audit_engines(configs=AUDIT_CONFIGS + ("gemma-3-4b",), tps=(1, 4, 8)) -> list[tuple]:
    """Every (config, TP, kind, options, label) the audit compiles: each of `configs` in :data:`AUDIT_CONFIGS` at
    each TP it shards to, in a decode and a prefill bucket, then :data:`AUDIT_ENGINES`, :data:`SMALL_CACHE_ENGINES`
    and :data:`HYBRID_KV_ENGINES` of `configs`."""
    from paged_jax.config import load_model_config
    from paged_jax.worker import sharding as shd

    out = []
    for config_name in (c for c in configs if c in AUDIT_CONFIGS):
        for tp in tps:
            try:
                if tp > 1:
                    shd.kv_replication(load_model_config(config_name), tp)
            except ValueError:
                continue  # the model does not shard this way
            out += [(config_name, tp, kind, (), "") for kind in AUDIT_KINDS]
    extra = AUDIT_ENGINES + SMALL_CACHE_ENGINES + HYBRID_KV_ENGINES
    return out + [e for e in extra if e[0] in configs and e[1] in tps]


def audit(configs=AUDIT_CONFIGS + ("gemma-3-4b",), tps=(1, 4, 8)) -> int:
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
        " and, when over 5% of one layer's KV, at 64 pages; growth = their difference / one layer's KV;"
        " w-copy = MiB of per-layer weight slices the step copies to HBM per step, beside the weights' MiB)"
    )
    print(
        f"{'config':<14}{'engine':<11}{'TP':>3}{'step':>8}{'bucket':>9}{'KV shape/chip':>28}{'copies':>7}"
        f"{'temp MiB':>10}{'at 64 pages':>12}{'layer KV MiB':>13}{'growth':>8}{'w-copy':>10}{'weights':>10}"
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
        hlo = compiled.as_text()
        bad = cache_copies(hlo, facts["cache_arrays"])
        weights = weight_copies(hlo, layer_weight_shapes(facts["engine"]), facts["num_layers"], facts["tokens"])
        growth = max(0, temp - temp_small) / facts["layer_kv"]
        shape = "x".join(str(d) for d in facts["local_kv_shape"])
        print(
            f"{config_name:<14}{label:<11}{tp:>3}{kind:>8}{f'{facts["tokens"]}x{facts["seqs"]}':>9}{shape:>28}"
            f"{len(bad):>7}{temp / 2**20:>10.1f}{temp_small / 2**20:>12.1f}{facts['layer_kv'] / 2**20:>13.1f}"
            f"{growth:>8.2%}{weights.hbm_bytes / 2**20:>10.0f}{facts['weights'] / 2**20:>10.0f}"
        )
        for line in bad[:4]:
            print(f"FAIL {name}: KV copy: {line}")
        if growth > MAX_TEMP_FRACTION:
            print(
                f"FAIL {name}: temporaries grow by {(temp - temp_small) / 2**20:.1f} MiB with the KV cache,"
                f" over {MAX_TEMP_FRACTION:.0%} of one layer's KV pages"
            )
        failures += bool(bad) + (growth > MAX_TEMP_FRACTION) + weight_copy_failed(name, weights)
    return failures


# The steps that still copy layer weights (MiB per step, the compiled v6e figure: more fails), and why. Every
# other step of the audit and the family table must copy none.
WEIGHT_COPY_ALLOWED: dict[str, tuple[float, str]] = {
    # head_dim 256: the prefill dot wants qkv_proj in (D, H) tiles, decode in (H, D), and the stacked weight is
    # kept head-major for decode (paged_jax.model.scan.STACKED_ORDERS); the head-batched dot that serves both
    # at head_dim 128 copies each slice at 256 (780 MiB for Gemma-3-4B), so the prefill step relays the whole
    # stacked qkv_proj out once (56 MiB per layer for Gemma-2-9B, 20 MiB for Gemma-3-4B).
    "gemma-2-9b TP1": (280, "qkv_proj relaid out for the prefill dot (head_dim 256)"),
    "gemma-3-4b TP1": (260, "qkv_proj relaid out for the prefill dot (head_dim 256)"),
    # the same at Gemma-3-4B's full depth (34 layers x 20 MiB), in the audit's hybrid KV prefill steps
    "gemma-3-4b hybrid KV TP1 prefill": (680, "qkv_proj relaid out for the prefill dot (head_dim 256)"),
    "gemma-3-4b hybrid 257p TP1 prefill": (680, "qkv_proj relaid out for the prefill dot (head_dim 256)"),
    # The experts' stacked [L, E, ...] weights: XLA:TPU writes each layer's slice out before its grouped
    # matmul (ragged-dot), where the dense dots read theirs in place.
    "mixtral-8x7b TP1": (5376, "each layer's expert weights sliced out for the ragged-dot"),
    "qwen3-30b-a3b TP1": (2304, "each layer's expert weights sliced out for the ragged-dot"),
    "qwen3-30b-a3b TP4": (960, "each layer's expert weights sliced out for the ragged-dot"),
}


def weight_copy_failed(name: str, weights) -> bool:
    """Print a failure and return True when the step `name` copies layer weights to HBM (`weights`: a
    ``paged_jax.worker.hlo_audit.WeightCopies``) beyond its allowance (:data:`WEIGHT_COPY_ALLOWED`, none for
    most steps): every dot must read its weight in place."""
    mib = weights.hbm_bytes / 2**20
    allowed, why = WEIGHT_COPY_ALLOWED.get(" ".join(name.split()), (0.0, ""))
    if mib and mib <= allowed:
        print(f"     {name}: w-copy {mib:.0f} MiB allowed (<= {allowed:g}): {why}")
    elif mib:
        print(f"FAIL {name}: w-copy: {mib:.1f} MiB of layer weights copied per step (allowed {allowed:g}):")
        for line in weights.lines[:2]:
            print(f"       {line}")
    return mib > allowed


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
        f"{'config':<15}{'layers':>7}{'TP':>3}{'copies':>7}{'temp MiB':>10}{'layer KV MiB':>13}{'w-copy':>8}"
        f"{'ragged-dot':>11}{'time':>7}  features"
    )
    for config_name in names:
        full = load_model_config(config_name)
        config = full.replace(num_layers=max(2, 2 * full.sliding_window_pattern + 1))
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
            bad = cache_copies(hlo, facts["cache_arrays"])
            temp = compiled.memory_analysis().temp_size_in_bytes
            grouped = len(GROUPED_MATMUL.findall(hlo))
            weights = weight_copies(hlo, layer_weight_shapes(facts["engine"]), facts["num_layers"], facts["tokens"])
            print(
                f"{config_name:<15}{config.num_layers:>7}{tp:>3}{len(bad):>7}{temp / 2**20:>10.1f}"
                f"{facts['layer_kv'] / 2**20:>13.1f}{weights.hbm_bytes / 2**20:>8.0f}{grouped:>11}"
                f"{time.perf_counter() - t0:>6.0f}s  {config.family_summary()}"
            )
            for line in bad[:4]:
                print(f"FAIL {name}: KV copy: {line}")
            if config.is_moe and not grouped:
                print(f"FAIL {name}: the experts did not lower to ragged-dot (grouped matmul)")
            failures += bool(bad) + (config.is_moe and not grouped) + weight_copy_failed(name, weights)
    return failures


HYBRID_CONFIG = "qwen3.5-9b"  # Qwen3.5-9B's text shapes (configs/qwen3.5-9b.json)
HYBRID_KINDS = ("decode", "prefill")
HYBRID_COPY_ROWS = 8  # one state-copy bucket (`ModelRunner.state_copy_job`)
# The kernels a hybrid step on TPU must run (kernel names in the compiled HLO): the gated delta rule on the
# recurrent rows and the state-row kernels on the conv rows (`paged_jax.model.linear_state`).
HYBRID_KERNELS = ("gated_delta_", "read_state_rows_tpu", "write_state_rows_tpu")


def check_hybrid(num_layers: int, kinds=HYBRID_KINDS, topo: str = "v6e:1x1") -> int:
    """The engine's step of a linear-attention hybrid (Qwen3.5-9B's shapes, its first `num_layers` layers: 4 is
    one group of three Gated DeltaNet layers and one full-attention layer, 32 the whole model) in each of
    `kinds`, on `topo`. Fails on a copy of a KV page array or of a state-pool array (conv or recurrent rows:
    `paged_jax.engine.aot.AbstractEngine.cache_arrays`), on a layer weight copied to HBM, and when a step does
    not run the hybrid's TPU kernels (:data:`HYBRID_KERNELS`). Prints per step the KV pages, the state pool and
    XLA's temporaries per chip."""
    from paged_jax.config import load_model_config

    failures = 0
    config = load_model_config(HYBRID_CONFIG)
    config = config.replace(num_layers=num_layers)
    print(
        f"\nlinear-attention hybrid: the engine's steps of {HYBRID_CONFIG} ({num_layers} layers: "
        f"{config.num_kv_layers} full attention), {topo}; MiB per chip"
    )
    print(
        f"{'step':>8}{'bucket':>9}{'KV shape':>22}{'KV MiB':>9}{'state pool MiB':>15}{'copies':>7}{'temp MiB':>10}"
        f"{'w-copy':>8}{'time':>7}  kernels"
    )
    engine = None
    for kind in kinds:
        t0 = time.perf_counter()
        try:
            compiled, facts = compile_step(topo, 1, config, kind)
        except Exception:  # noqa: BLE001 - every compiler error is a failure to report
            failures += 1
            print(f"FAIL {HYBRID_CONFIG} {kind}\n{traceback.format_exc(limit=4)}")
            continue
        engine, hlo = facts["engine"], compiled.as_text()
        bad = cache_copies(hlo, engine.cache_arrays)
        weights = weight_copies(hlo, layer_weight_shapes(engine), num_layers, facts["tokens"])
        calls = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
        kernels = {k: sum(k in line for line in calls) for k in HYBRID_KERNELS}
        kv = facts["layer_kv"] * config.num_kv_layers
        temp = compiled.memory_analysis().temp_size_in_bytes
        print(
            f"{kind:>8}{f'{facts["tokens"]}x{facts["seqs"]}':>9}{'x'.join(map(str, engine.local_kv_shape)):>22}"
            f"{kv / 2**20:>9.0f}{engine.state_pool_bytes / 2**20:>15.1f}{len(bad):>7}{temp / 2**20:>10.1f}"
            f"{weights.hbm_bytes / 2**20:>8.0f}{time.perf_counter() - t0:>6.0f}s  "
            + ", ".join(f"{k.rstrip('_')} x{n}" for k, n in kernels.items())
        )
        for line in bad[:4]:
            print(f"FAIL {HYBRID_CONFIG} {kind}: cache copy: {line}")
        missing = [k for k, n in kernels.items() if not n]
        if missing:
            print(f"FAIL {HYBRID_CONFIG} {kind}: the step runs none of {', '.join(missing)}")
        failures += bool(bad) + bool(missing) + weight_copy_failed(f"{HYBRID_CONFIG} TP1 {kind}", weights)
    return failures + (check_hybrid_copies(engine) if engine is not None else 0)


def check_hybrid_copies(engine) -> int:
    """The hybrid engine's state-row copies (forks, snapshots, restores: `ModelRunner.state_copy_job`; `engine`:
    a ``paged_jax.engine.aot.AbstractEngine``) compiled; fails on a copy of a KV page or state-pool array."""
    t0 = time.perf_counter()
    try:
        copy = engine.compile(engine.runner.state_copy_job(HYBRID_COPY_ROWS))
    except Exception:  # noqa: BLE001 - every compiler error is a failure to report
        print(f"FAIL {HYBRID_CONFIG} state copy\n{traceback.format_exc(limit=4)}")
        return 1
    bad = cache_copies(copy.as_text(), engine.cache_arrays)
    calls = [line for line in copy.as_text().splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    print(
        f"{'copy':>8}{HYBRID_COPY_ROWS:>9}{'':>55}{len(bad):>7}{'':>18}{time.perf_counter() - t0:>6.0f}s  "
        f"state rows x{sum('state_rows_tpu' in line for line in calls)}"
    )
    for line in bad[:4]:
        print(f"FAIL {HYBRID_CONFIG} state copy: cache copy: {line}")
    return bool(bad)


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
        f"{'peak':>8}{'copies':>7}{'w-copy':>8}"
    )
    # bfloat16 weights (15 GiB for the 8B) do not fit a 16 GiB chip at all: XLA refuses the step (RESOURCE_EXHAUSTED).
    # fp8 pages only in the decode step: the prefill step differs from int8's by the page dtype alone (same bytes,
    # same scale arrays, same write), and the kernel sweep compiles fp8 pages in prefill and mixed buckets.
    for quantization, kv_dtype, kinds in (("int8", "int8", QUANTIZED_STEPS), ("int8", "fp8_e4m3", ("decode",))):
        for kind in kinds:
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
            hlo = compiled.as_text()
            bad = cache_copies(hlo, facts["cache_arrays"])
            weights = weight_copies(hlo, layer_weight_shapes(facts["engine"]), facts["num_layers"], facts["tokens"])
            print(
                f"{quantization or 'bf16':<8}{kv_dtype or 'bf16':<10}{facts['tokens']:>7}{facts['seqs']:>5}"
                f"{facts['weights'] * gib:>9.2f}{facts['layer_kv'] * facts['num_layers'] * gib:>8.2f}"
                f"{facts['kv_tokens']:>11,}{m.temp_size_in_bytes * gib:>8.2f}{peak:>8.2f}{len(bad):>7}"
                f"{weights.hbm_bytes * gib:>8.2f}  ({time.perf_counter() - t0:.0f}s)"
            )
            for line in bad[:4]:
                print(f"FAIL {name}: KV copy: {line}")
            failures += bool(bad) + (peak > hbm) + weight_copy_failed(name, weights)
            if peak > hbm:
                print(f"FAIL {name}: peak {peak:.2f} GiB exceeds {hbm} GiB")
            if quantization == "int8" and kv_dtype == "int8" and facts["kv_tokens"] < MIN_QUANTIZED_KV_TOKENS:
                failures += 1
                print(f"FAIL {name}: {facts['kv_tokens']:,} KV tokens < {MIN_QUANTIZED_KV_TOKENS:,}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--topologies",
        nargs="*",
        default=["v6e:1x1", "v5e:1x1"],
        help="kernel sweep targets: the first gets every case, the others SECOND_GENERATION_CASES",
    )
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
    parser.add_argument(
        "--hybrid",
        type=int,
        default=0,
        metavar="LAYERS",
        help=f"compile {HYBRID_CONFIG}'s decode and prefill steps with its first LAYERS layers (4: one 3:1 group;"
        " 32: the whole model; 0: skip, the default: minutes on two cores)",
    )
    args = parser.parse_args()
    failures = 0
    for i, topo in enumerate(args.topologies):
        failures += check_kernels(topo, CASES if i == 0 else SECOND_GENERATION_CASES)
    if args.audit:
        failures += audit()
    if args.families:
        failures += check_families(args.families)
    if args.sharded:
        failures += check_sharded(args.sharded, args.sharded_model, args.hbm_gib)
    for topo in args.quantized or ():
        failures += check_quantized(topo, args.quantized_model, args.hbm_gib)
    if args.hybrid:
        failures += check_hybrid(args.hybrid)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
