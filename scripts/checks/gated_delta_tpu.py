"""The gated delta rule kernels (``pallas_kernels.tpu.gated_delta``) compiled for real TPU targets without a TPU,
at Qwen3.5-9B's linear-attention shapes: part of ``check_tpu_compile.py`` (``make tpu-check``).

Qwen3.5-9B's Gated DeltaNet layer has 32 value heads and 16 key heads of 128 (``Dk = Dv = 128``); the kernels
take the key heads already repeated to the value heads, so a call is 32 heads of ``[128, 128]`` float32 state
(2 MiB per sequence and layer). Each case compiles one call inside a jit that donates the pool, as the engine
step does, and fails on a Mosaic error, on a VMEM plan over the chip's budget (``pallas_kernels.tpu.limits``
refuses it at trace time), or when the compiled HLO copies the pool (``paged_jax.worker.hlo_audit.kv_copies``:
any instruction producing an array of the pool's shape other than in place). It prints the VMEM plan of both
kernels and the work model's bytes and FLOPs of the case's own batch (``pallas_kernels.gated_delta_plan``),
with the roofline time on the target.
"""

from __future__ import annotations

import time
import traceback
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from paged_jax.worker.hlo_audit import kv_copies
from pallas_kernels.gated_delta_plan import gated_delta_work, plan_gated_delta
from pallas_kernels.tpu.gated_delta import _ALIGN, chunk_vmem_bytes, decode_vmem_bytes, gated_delta_tpu
from pallas_kernels.work_model import HARDWARE

HEADS, KEY_DIM, VALUE_DIM = 32, 128, 128  # Qwen3.5-9B: 32 value heads, 16 key heads repeated, Dk = Dv = 128


class GatedDeltaCase(NamedTuple):
    """One call: ``num_tokens`` over ``max_seqs`` sequence rows; the batch of the work figures is ``lens``."""

    name: str
    num_tokens: int
    max_seqs: int
    lens: tuple[int, ...]  # the sequences' tokens this step (the work model's batch)
    dtype: object = jnp.bfloat16  # q, k, v

    def __str__(self) -> str:
        return f"gated-delta {self.name} {self.num_tokens}x{self.max_seqs} {jnp.dtype(self.dtype).name}"


CASES = [
    GatedDeltaCase("prefill 4x512", 2048, 8, (512,) * 4),
    GatedDeltaCase("chunked prefill + decodes", 1024, 64, (512, 449) + (1,) * 62),
    GatedDeltaCase("decode 64", 64, 64, (1,) * 64),
    GatedDeltaCase("decode 256", 256, 256, (1,) * 256),
    GatedDeltaCase("prefill 512 f32", 512, 4, (300, 212), jnp.float32),
]


def case_args(sharding, case: GatedDeltaCase):
    """The call's abstract operands (entry-point order) placed with ``sharding``."""
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    t, s, h = case.num_tokens, case.max_seqs, HEADS
    return (
        sds((t, h, KEY_DIM), case.dtype),
        sds((t, h, KEY_DIM), case.dtype),
        sds((t, h, VALUE_DIM), case.dtype),
        sds((t, h), jnp.float32),
        sds((t, h), jnp.float32),
        sds((s + 1,), jnp.int32),
        sds((1,), jnp.int32),
        sds((s,), jnp.int32),
        sds((s,), jnp.bool_),
        sds((s + 1, h, KEY_DIM, VALUE_DIM), jnp.float32),  # a slot per sequence and the null slot
    )


def compile_case(device, generation: str, case: GatedDeltaCase):
    fn = jax.jit(lambda *a: gated_delta_tpu(*a, generation=generation), donate_argnums=(9,))
    mesh = jax.sharding.Mesh([device], ("x",))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return fn.lower(*case_args(SingleDeviceSharding(device), case)).compile()


def describe(case: GatedDeltaCase, generation: str) -> str:
    """VMEM plans and the work model's figures of the case's batch (one layer)."""
    plan = plan_gated_delta(case.num_tokens, case.max_seqs, HEADS, KEY_DIM, VALUE_DIM)
    itemsize = jnp.dtype(case.dtype).itemsize
    cu = np.zeros(case.max_seqs + 1, np.int32)
    cu[1 : len(case.lens) + 1] = np.cumsum(case.lens)
    cu[len(case.lens) + 1 :] = cu[len(case.lens)]
    chunk, decode = gated_delta_work(plan, cu, len(case.lens), itemsize, rows=plan.chunk + _ALIGN)
    hw = HARDWARE.get(generation)
    parts = []
    for label, w in (("chunk", chunk), ("decode", decode)):
        if w.programs:
            secs = f" {w.seconds(hw) * 1e6:.0f} us on {hw.name}" if hw else ""
            parts.append(
                f"{label}: {w.programs} items, state {w.kv_bytes_read / 2**20:.0f} MiB, rows"
                f" {(w.q_bytes + w.out_bytes) / 2**20:.1f} MiB, {w.issued_flops / 1e9:.1f} GFLOP issued"
                f" ({w.useful_flops / max(w.issued_flops, 1):.0%} useful){secs}"
            )
    vmem = (chunk_vmem_bytes(plan, itemsize) / 2**20, decode_vmem_bytes(plan, 4) / 2**20)
    return f"VMEM chunk {vmem[0]:.1f} MiB decode {vmem[1]:.1f} MiB; " + "; ".join(parts)


def check(device, generation: str, cases=CASES) -> int:
    """Compile and audit each case for ``device``; returns the failure count."""
    failures = 0
    for case in cases:
        name = f"{generation} {case}"
        t0 = time.perf_counter()
        try:
            compiled = compile_case(device, generation, case)
            pool = (case.max_seqs + 1, HEADS, KEY_DIM, VALUE_DIM)
            copies = kv_copies(compiled.as_text(), pool, jnp.float32)
            if copies:
                failures += 1
                print(f"FAIL {name}: the step copies the state pool:\n  " + "\n  ".join(copies[:3]))
                continue
            print(f"ok   {name} ({time.perf_counter() - t0:.1f}s) {describe(case, generation)}")
        except Exception:  # noqa: BLE001 - every compiler error is a failure to report
            failures += 1
            print(f"FAIL {name}\n{traceback.format_exc(limit=3)}")
    return failures
