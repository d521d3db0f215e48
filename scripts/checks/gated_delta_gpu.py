"""The gated delta rule's Triton kernel (``pallas_kernels.gpu.gated_delta``) compiled for an H200 (sm_90a)
without a GPU, at Qwen3.5-9B's linear-attention shapes: part of ``check_gpu_compile.py`` (``make gpu-check``).

The cases are the TPU check's (``gated_delta_tpu.CASES``: 32 value heads, ``Dk = Dv = 128``, prefill 4 x 512,
chunked prefill with decodes, decode 64 and 256, float32 inputs). Each compiles one call inside a jit that
donates the pool, as the engine step does, and fails on a compile error (a register spill is one: the
compiler is told to fail on it), when ptxas reports spill bytes, or when the compiled HLO copies the pool
(``paged_jax.worker.hlo_audit.kv_copies``). It prints the kernel's registers, shared memory and grid.
"""

from __future__ import annotations

import time
import traceback

import gated_delta_tpu
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.worker.hlo_audit import kv_copies
from pallas_kernels.analysis.gpu_aot import HEADER, H200Compiler
from pallas_kernels.gpu.gated_delta import gated_delta_gpu

CASES = gated_delta_tpu.CASES


def check(compiler: H200Compiler, cases=CASES) -> int:
    """Compile and audit each case; returns the failure count."""
    mesh = jax.sharding.Mesh(np.array(compiler.devices[:1]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    print("\nGated delta rule kernel compiled for H200 (sm_90a), Qwen3.5-9B linear-attention shapes")
    print(f"{'case':<58}{HEADER}")
    failures = 0
    for case in cases:
        t0 = time.perf_counter()
        args = gated_delta_tpu.case_args(sharding, case)
        fn = jax.jit(gated_delta_gpu, donate_argnums=(9,))
        try:
            compiled, reports = compiler.compile(None, mesh=mesh, lower=lambda f=fn, a=args: f.lower(*a))
        except Exception:  # noqa: BLE001 - every compiler error is a failure to report
            failures += 1
            print(f"FAIL {case} ({time.perf_counter() - t0:.0f}s)\n{traceback.format_exc(limit=3)}")
            continue
        kernels = [r for r in reports if r.name.startswith("gated_delta_gpu")]
        for r in kernels:
            print(f"{str(case):<58}{r.row()}")
        bad = [] if kernels else ["no gated_delta_gpu kernel in the compiled call"]
        bad += [f"{r.name}: {r.spill_bytes} bytes of register spills" for r in kernels if r.spill_bytes]
        pool = (case.max_seqs + 1, gated_delta_tpu.HEADS, gated_delta_tpu.KEY_DIM, gated_delta_tpu.VALUE_DIM)
        bad += [f"copies the state pool: {line}" for line in kv_copies(compiled.as_text(), pool, jnp.float32)[:3]]
        for line in bad:
            print(f"FAIL {case}: {line}")
        failures += bool(bad)
        print(f"{'':<58}({time.perf_counter() - t0:.1f}s)")
    return failures
