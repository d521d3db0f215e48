"""Ahead-of-time compile of the GPU kernel and the engine step for an H200 (sm_90a), on a machine without a GPU.

The twin of ``check_tpu_compile.py``; runs from ``.venv-gpu`` (``make gpu-check``: jax's CUDA plugin, its PJRT
and the ``nvidia-cuda-nvcc`` wheel's ptxas; no GPU, no system CUDA). Compiles through XLA, Triton, LLVM NVPTX
and ``ptxas -arch=sm_90a`` to SASS (:mod:`pallas_kernels.gpu_aot`) and exits non-zero on any failure.

**Kernel cases** (:data:`KERNEL_CASES`): every value of every axis once (bucket kind: decode, split-KV decode,
prefill, mixed; head_dim 64/128/256; page size 16/32/64/128; KV dtype bf16/int8/fp8_e4m3; query group 1/3/4/7/8;
sliding window; soft cap), plus the pairs that interact (dtype x page size, dtype x prefill, head_dim x prefill,
group x prefill, window x prefill), not the full product. Per kernel it prints registers, spill bytes, shared
memory, threads, grid, whether the loop's loads are asynchronous copies (``cp.async``/TMA), which MMA it issues
(wgmma or mma.sync), and whether some KV loop feeds the MMA with no select in between. It fails on a spill
(spills are fatal to the compile), on shared memory over the H200's 227 KiB per block (XLA refuses it), when the
attention kernel of a decode or prefill case loses its asynchronous page gather or its unmasked KV loop, and
when a prefill kernel of head_dim >= 128 does not issue wgmma.

**Engine steps** (``--steps``): see :func:`check_steps`.

    .venv-gpu/bin/python scripts/check_gpu_compile.py [--cases NAME ...] [--no-steps]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax: the CUDA plugin must not look for a GPU

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import kv_quant  # noqa: E402
from pallas_kernels.common import kv_pages_shape  # noqa: E402
from pallas_kernels.gpu_aot import HEADER, H200Compiler, KernelReport  # noqa: E402
from pallas_kernels.gpu_ragged_paged_attention import ragged_paged_attention_gpu  # noqa: E402


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
            sds((self.num_tokens, self.num_q_heads, self.head_dim), jnp.bfloat16),
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
    # Each axis, every value (the first case is the base: a Llama-3-8B decode bucket).
    KernelCase("decode"),
    KernelCase("split-kv", **_SPLIT),
    KernelCase("prefill", **_PREFILL),
    KernelCase("mixed", **_MIXED),
    KernelCase("hd64", num_q_heads=32, num_kv_heads=8, head_dim=64),
    KernelCase("hd256", num_q_heads=16, num_kv_heads=8, head_dim=256),
    KernelCase("page32", page_size=32, max_blocks=256),
    KernelCase("page64", page_size=64, max_blocks=128),
    KernelCase("page128", page_size=128, max_blocks=64),
    KernelCase("int8", kv_dtype="int8"),
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
    KernelCase("hd256-fp8-split", num_q_heads=16, head_dim=256, kv_dtype="float8_e4m3fn", **_SPLIT),
)


def kernel_failures(case: KernelCase, reports: list[KernelReport]) -> list[str]:
    """What the compiled text must show (module docstring); spills and shared memory already fail the compile."""
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
        if r.name.endswith("_prefill") and case.head_dim >= 128 and r.mma != "wgmma":
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
        bad = kernel_failures(case, reports)
        for line in bad:
            print(f"FAIL {case.name}: {line}")
        failures += bool(bad)
        print(f"{'':<24}({time.perf_counter() - t0:.1f}s)")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [c.name for c in KERNEL_CASES]
    parser.add_argument("--cases", nargs="*", default=names, choices=names, metavar="CASE")
    args = parser.parse_args()
    t0 = time.perf_counter()
    compiler = H200Compiler()
    try:
        failures = check_kernels(compiler, [c for c in KERNEL_CASES if c.name in args.cases])
    finally:
        compiler.close()
    print(f"{failures} failure(s) ({time.perf_counter() - t0:.0f}s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
